"""Flat buffers for ZeRO: parameters laid end to end, padded so k shards are equal.

A `FlatLayout` fixes where every parameter lives in one 1-D buffer of `padded` elements,
a multiple of the group size k; rank r owns elements [r * shard, (r + 1) * shard) with
shard = ceil(n / k), the planner's shard size (plan/memory.py). Padding, at most k - 1
elements, sits at the end of the last rank's shard and always holds zeros, so it adds
nothing to norms or reductions. A parameter may straddle two shards: each rank then owns a
contiguous piece of its flattened values (`local_pieces`), and that piece together with the
parameter's global shape and offset is what a sharded checkpoint stores (the same
information FSDP2's DTensor carries; torch.distributed.checkpoint can be fed from it).

`FlatShard` is one rank's part of one flat buffer, as the sharded optimizer sees it: the
compute-dtype parameters, the reduced gradient, and the fp32 master copy when mixed
precision has one. `FlatBucket`s cut the buffer into the ranges that ZeRO-1/2 reduce as
one call each, from backward hooks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass(frozen=True)
class Segment:
    """One parameter inside a flat buffer."""

    name: str  # as in module.named_parameters()
    shape: torch.Size  # its global shape
    start: int  # first element in the flat buffer
    numel: int

    @property
    def end(self) -> int:
        return self.start + self.numel


@dataclass(frozen=True)
class Piece:
    """The part of one parameter that one rank owns: flattened elements [lo, hi)."""

    segment: Segment
    lo: int  # within the parameter, flattened
    hi: int
    shard_offset: int  # where it starts in the owning rank's shard

    @property
    def numel(self) -> int:
        return self.hi - self.lo


class FlatLayout:
    """Offsets of `params` (in the given order) in a flat buffer split into k equal shards."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], k: int) -> None:
        self.k = k
        self.segments: list[Segment] = []
        offset = 0
        for name, p in named_params:
            self.segments.append(Segment(name, p.shape, offset, p.numel()))
            offset += p.numel()
        self.numel = offset
        self.shard = math.ceil(offset / k) if offset else 0  # planner: ceil(n / k)
        self.padded = self.shard * k
        self.padding = self.padded - self.numel

    def shard_range(self, rank: int) -> tuple[int, int]:
        return rank * self.shard, (rank + 1) * self.shard

    def split_sizes(self, start: int, end: int) -> list[int]:
        """Elements of flat range [start, end) owned by each rank (a reduce-scatter's sizes)."""
        sizes = []
        for r in range(self.k):
            lo, hi = self.shard_range(r)
            sizes.append(max(0, min(end, hi) - max(start, lo)))
        return sizes

    def local_pieces(self, rank: int) -> list[Piece]:
        lo, hi = self.shard_range(rank)
        pieces = []
        for seg in self.segments:
            a, b = max(seg.start, lo), min(seg.end, hi)
            if a < b:
                pieces.append(Piece(seg, a - seg.start, b - seg.start, a - lo))
        return pieces

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's view into a full flat buffer, shaped like the parameter."""
        return [flat[s.start : s.end].view(s.shape) for s in self.segments]


@dataclass
class FlatShard:
    """One rank's part of one flat buffer: what the sharded optimizer updates.

    param: (shard,) compute-dtype weights this rank owns (a view into the full flat buffer
        for ZeRO-1/2; the only copy for ZeRO-3).
    grad: (shard,) the reduced gradient, in the gradient dtype.
    master: (shard,) fp32 master weights, or None when param is already fp32.
    """

    layout: FlatLayout
    rank: int
    param: torch.Tensor
    grad: torch.Tensor
    master: torch.Tensor | None

    @property
    def optimized(self) -> torch.Tensor:
        """The fp32 tensor Adam updates: the master copy, or the parameters themselves."""
        return self.master if self.master is not None else self.param

    def piece_views(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Views of `tensor` (shaped like the shard) over each parameter's piece."""
        return [
            tensor[p.shard_offset : p.shard_offset + p.numel]
            for p in self.layout.local_pieces(self.rank)
        ]


def flatten(
    params: list[nn.Parameter], layout: FlatLayout, dtype: torch.dtype, master: bool, rank: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Copy `params` into one padded buffer of `dtype` and make them views of it; with
    `master`, also the fp32 values of `rank`'s shard (taken before rounding to `dtype`)."""
    full = torch.zeros(layout.padded, device=params[0].device)  # fp32
    for p, view in zip(params, layout.views(full), strict=True):
        view.copy_(p.detach())
    flat = full if dtype == torch.float32 else full.to(dtype)
    for p, view in zip(params, layout.views(flat), strict=True):
        p.data = view
    lo, hi = layout.shard_range(rank)
    return flat, (full[lo:hi] if master else None)


def make_shard(
    layout: FlatLayout,
    rank: int,
    param: torch.Tensor,
    grad_dtype: torch.dtype,
    master_from: torch.Tensor | None,
) -> FlatShard:
    """A FlatShard over `param`, with a zeroed gradient and, if given, an fp32 master copy.

    master_from: None for fp32 training, else the (shard,) fp32 values to start the master
    weights from (taken before the weights were rounded to 16 bits).
    """
    grad = param.new_zeros(layout.shard, dtype=grad_dtype)
    master = None if master_from is None else master_from.detach().float().clone()
    return FlatShard(layout, rank, param, grad, master)


@dataclass
class FlatBucket:
    """A contiguous range [start, end) of the flat buffer, reduced as one call."""

    index: int
    start: int
    end: int
    params: list[int]  # indices into the layout's segments
    ready: set[int] = field(default_factory=set)
    buffer: torch.Tensor | None = None  # stage 2: (end - start,) full gradients, transient


def flat_buckets(layout: FlatLayout, bucket_bytes: int, element_size: int) -> list[FlatBucket]:
    """Cut the flat buffer into buckets of about bucket_bytes at parameter boundaries.

    The last bucket also covers the padding, so buckets tile [0, padded) and a rank's sent
    bytes sum to exactly (k-1)/k of the padded buffer. bucket_bytes <= 0: one bucket.
    """
    buckets: list[FlatBucket] = []
    current: list[int] = []
    start = 0
    for i, seg in enumerate(layout.segments):
        size = (seg.end - start) * element_size
        if current and bucket_bytes > 0 and size > bucket_bytes:
            buckets.append(FlatBucket(len(buckets), start, seg.start, current))
            current, start = [], seg.start
        current.append(i)
    buckets.append(FlatBucket(len(buckets), start, layout.padded, current))
    return buckets
