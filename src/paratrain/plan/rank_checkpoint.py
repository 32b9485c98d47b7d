"""What each rank puts in a checkpoint: the tensor bytes of its part, before
torch.distributed.checkpoint drops the boxes that other ranks write too.

A checkpoint stores every parameter's value and its optimizer moments under the plain
model's names (checkpoint/state.py), each rank the boxes it holds: the fp32 values it
updates (the master copy in mixed precision) and the moments beside them. Without ZeRO a
rank holds its chunks' parameters whole; under ZeRO (ZeRO-1 to 3 alike: the optimizer
owns the shard) its range of each flat buffer, never the padding: the rank at position r
of k holds elements [r ceil(n / k), (r + 1) ceil(n / k)) of a buffer of n, cut at n.
Tensor parallelism's slices and a pipeline's stages are in the buffers already
(rank_memory.flat_buffers). `paratrain simulate` measures it as DCP's local save plan.

Not predicted (None) where more or other state is saved: LoRA, Muon, --compress, a
mixture of experts, DiLoCo's outer state.
"""

from __future__ import annotations

import math

from paratrain.plan.layout import Layout, Workload
from paratrain.plan.model import ModelSpec
from paratrain.plan.rank_groups import Coords, shard_rank
from paratrain.plan.rank_memory import flat_buffers, plain_training


def held_elements(n: int, k: int, position: int) -> int:
    """Elements of a flat buffer of n that the rank at `position` of k owns, padding not."""
    shard = math.ceil(n / k)
    return max(0, min(shard, n - position * shard))


def checkpoint_bytes(
    model: ModelSpec, workload: Workload, layout: Layout, at: Coords
) -> int | None:
    """The tensor bytes of this rank's part of a checkpoint (module docstring)."""
    if not plain_training(model, workload):
        return None
    buffers = [n for chunk in flat_buffers(model, layout, at.stage) for n in chunk]
    k = layout.shard_ranks if layout.zero else 1
    mine = sum(held_elements(n, k, shard_rank(layout, at) if layout.zero else 0) for n in buffers)
    p = workload.precision
    return mine * ((p.master_bytes or p.param_bytes) + workload.moments * p.moment_bytes)
