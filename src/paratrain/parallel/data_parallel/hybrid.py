"""HSDP: ZeRO within a replica group, the reduced shards all-reduced across the groups.

Hybrid sharding (PyTorch FSDP, Zhao et al., arXiv:2304.11277, section 3.2.2; FSDP2's
`fully_shard` on a 2-D mesh (replicate, shard)): the k data-parallel ranks form R replica
groups of s = k / R consecutive ranks (mesh.py: "dp_shard"). Within a group the wrappers
shard, reduce-scatter and gather exactly as plain ZeRO does with s ranks; the ranks at the
same position of every group hold the same shard ("dp_replicate"), so after the last
reduce-scatter of the step each rank all-reduces its reduced shard over those R ranks.

Why once per step, at `finish_gradient_sync`, and not after each reduce-scatter: the
shards accumulate linearly across micro-batches (a sum, or with reduce_op "avg" a mean
over equal groups: the mean of the group means is the mean over all k ranks), so one
all-reduce gives the same gradient with R-1/R of the traffic of K; and it is issued at
the same point of the step on every rank, whereas a reduce-scatter completes whenever
its bucket does, which would interleave the two groups' calls differently on different
ranks (NCCL's ordering rule: docs/comm.md). Traffic per step: 2(R-1)/R of the shards'
gradient bytes in the reduce dtype, on top of ZeRO's over s ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paratrain import comm
from paratrain.comm.group import CommGroup
from paratrain.parallel.data_parallel.compression import GradCompressor


@dataclass(frozen=True)
class HybridGroups:
    """The two groups of HSDP for one rank: `shard`, its replica group (ZeRO over it),
    and `replicate`, the ranks holding the same shards in the other replica groups."""

    shard: CommGroup
    replicate: CommGroup


def all_reduce_across_replicas(
    grads: list[torch.Tensor],
    replicate: CommGroup,
    op: str,
    dtype: torch.dtype,
    compressor: GradCompressor | None = None,
) -> None:
    """Reduce this rank's reduced gradient shards over `replicate`, in place, in one call
    in `dtype` (the wrappers' reduce dtype: fp32 by default, as their reduce-scatters), or
    through `compressor` (its buffer "replicate", compression.py) once it is active."""
    if replicate.size == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads]).to(dtype)
    if compressor is not None and compressor.active:
        flat = compressor.reduce("replicate", flat.float(), replicate, op, None).to(dtype)
    else:
        comm.all_reduce(flat, replicate, op=op)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
