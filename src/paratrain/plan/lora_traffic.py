"""What a LoRA run's data-parallel wrappers send (plan/lora.py counts what they hold).

Only the adapters have gradients: DP all-reduces them, ZeRO-1/2 reduce-scatter them and
all-gather the updated adapters, ZeRO-3 gathers and reduce-scatters the adapters' units
as any unit's (rank_traffic.py's formulas on the adapters' flat buffers, `lora_chunks`).
The frozen base moves only under ZeRO-3, which shards it: each unit's frozen buffer is
all-gathered for forward and again for backward, in the compute dtype, except the
embedding's and a tied root's, whose backward needs no weight of theirs (the token ids
need no gradient): `frozen_gathers`.

Over tp (`lora_tp_terms`, found by `paratrain simulate --lora-rank 4 --tp 2`): the first
block's input gradient is never computed (nothing below it trains), so its
column-parallel all-reduce is not sent, once per micro-batch on the first virtual stage
(under sequence parallelism its reduce-scatter, and the all-gather that the embedding's
reduce-scatter has for backward). The adapters left whole on every tp rank have partial
gradients, summed over tp (held_pieces.py).
"""

from __future__ import annotations

import math
from dataclasses import replace

from paratrain.plan import comm
from paratrain.plan.layout import Layout, Workload
from paratrain.plan.lora import adapter_buffers
from paratrain.plan.model import ModelSpec
from paratrain.plan.pipeline import stage_virtual_stages, virtual_stage_layers
from paratrain.plan.rank_groups import Coords, RankTraffic, group_name
from paratrain.plan.rank_memory import flat_buffers, tied_root


def lora_chunks(
    model: ModelSpec, layout: Layout, stage: int, workload: Workload
) -> list[list[int]]:
    """The adapters' flat buffers on `stage`, per chunk (each chunk is wrapped on its own)."""
    assert workload.lora is not None
    s, c = layout.pp, layout.chunks
    layers = virtual_stage_layers(model.shape.n_layer, s, c)
    vss = stage_virtual_stages(stage, s, c)
    return [adapter_buffers(model, workload.lora, layout, [layers[vs]]) for vs in vss]


def frozen_gathers(
    model: ModelSpec, workload: Workload, layout: Layout, microbatches: int, stage: int
) -> list[RankTraffic]:
    """ZeRO-3's all-gathers of the frozen base on `stage`: (k - 1) ceil(n / k) elements per
    unit of n, for forward and (but the embedding's and a tied root's) for backward, per
    micro-batch."""
    if layout.zero < 3 or layout.shard_ranks == 1:
        return []
    k, p = layout.shard_ranks, workload.precision.param_bytes
    root = tied_root(model, layout, stage)
    forward = backward = 0
    for vs, chunk in zip(stage_virtual_stages(stage, layout.pp, layout.chunks),
                         flat_buffers(model, layout, stage), strict=True):  # fmt: skip
        no_backward = (1 if root else 0) + (1 if vs == 0 else 0)  # the root, the embedding
        for i, n in enumerate(chunk):
            sent = (k - 1) * math.ceil(n / k) * p * microbatches
            forward += sent
            backward += 0 if i < no_backward else sent
    dp = group_name("dp_shard", layout)
    return [
        RankTraffic(dp, "all_gather", "frozen parameters for forward", forward),
        RankTraffic(dp, "all_gather", "frozen parameters for backward", backward),
    ]


def lora_tp_terms(
    terms: list[RankTraffic],
    model: ModelSpec,
    workload: Workload,
    layout: Layout,
    microbatches: int,
    at: Coords,
) -> list[RankTraffic]:
    """rank_traffic's tp `terms` (the activations' first) for a LoRA run: the first
    block's input gradient not sent (module docstring)."""
    if (
        layout.tp == 1
        or not terms
        or 0 not in stage_virtual_stages(at.stage, layout.pp, layout.chunks)
    ):
        return terms
    size = comm.activation_message_bytes(model, workload, layout.cp)
    skipped = microbatches * comm.all_reduce_bytes(size, layout.tp)  # with sp: its two halves
    return [replace(terms[0], bytes=terms[0].bytes - skipped), *terms[1:]]
