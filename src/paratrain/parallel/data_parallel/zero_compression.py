"""The compressor of a flat-buffer wrapper (zero.py): which buffers it reduces, and how.

Without HSDP, each bucket of the flat buffer, all-reduced at stage 0 and reduce-scattered
at stages 1 and 2, over the data-parallel group. Under HSDP only the reduction across the
replica groups is compressed (the slow link): one buffer, the rank's gradient shard,
all-reduced over its replicate group; within a group the reduce-scatters stay exact.
"""

from __future__ import annotations

import torch

from paratrain import comm
from paratrain.parallel.data_parallel.compression import (
    CompressSettings,
    GradCompressor,
    reduced_buffer,
)
from paratrain.parallel.data_parallel.flat_buffer import FlatBucket, FlatLayout
from paratrain.parallel.data_parallel.hybrid import HybridGroups


def flat_compressor(
    settings: CompressSettings | None,
    layout: FlatLayout,
    buckets: list[FlatBucket],
    group: comm.CommGroup,
    hybrid: HybridGroups | None,
    stage: int,
    device: torch.device,
) -> GradCompressor | None:
    """None without `settings`, or where there is nothing to reduce (a group of one)."""
    if settings is None:
        return None
    if hybrid is not None:
        replicate = hybrid.replicate
        if replicate.size == 1:
            return None
        shard = reduced_buffer("replicate", [], layout.shard, replicate, True, settings)
        return GradCompressor(settings, [shard], device)
    if group.size == 1:
        return None
    reduced = []
    for b in buckets:
        segments = [layout.segments[i] for i in b.params]
        shapes = [(s.start - b.start, s.shape) for s in segments]
        whole = stage == 0  # an all-reduce; else a reduce-scatter
        key = f"bucket{b.index}"
        reduced.append(reduced_buffer(key, shapes, b.end - b.start, group, whole, settings))
    return GradCompressor(settings, reduced, device)


def compressed_bucket(
    compressor: GradCompressor,
    layout: FlatLayout,
    bucket: FlatBucket,
    send: torch.Tensor,
    group: comm.CommGroup,
    stage: int,
    op: str,
) -> comm.Pending:
    """A bucket's reduction through `compressor`, done where it completes (no overlap):
    its whole mean at stage 0, this rank's part of it at stages 1 and 2."""
    sizes = None if stage == 0 else layout.split_sizes(bucket.start, bucket.end)
    result = compressor.reduce(f"bucket{bucket.index}", send.float(), group, op, sizes)
    return comm.Done(result.to(send.dtype))
