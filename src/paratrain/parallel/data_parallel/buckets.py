"""Gradient buckets: parameters grouped in reverse order of use, each with one flat buffer.

Gradients are produced from the last layer backwards, so buckets filled in reverse order
of registration become complete one after another during the backward pass, and each can
be all-reduced while the earlier layers are still computing (PyTorch DDP, Li et al. 2020,
arXiv:2006.15704, section 3.2.3). Each parameter's `.grad` is a view into its bucket's
buffer, so autograd accumulates micro-batches in place and nothing is copied to launch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class Bucket:
    index: int
    params: list[nn.Parameter]
    buffer: torch.Tensor  # (sum of numels,) flat gradients of `params`
    views: list[torch.Tensor] = field(default_factory=list)  # per param, shaped like it
    ready: set[int] = field(default_factory=set)  # ids of params whose grad is complete

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def is_complete(self) -> bool:
        return len(self.ready) == len(self.params)


FIRST_BUCKET_BYTES = 2**20  # PyTorch DDP's first-bucket cap (1 MiB)


def build_buckets(
    params: list[nn.Parameter],
    bucket_bytes: int,
    dtype: torch.dtype | None = None,
    first_bucket_bytes: int = FIRST_BUCKET_BYTES,
) -> list[Bucket]:
    """Fill buckets of about `bucket_bytes` from the last parameter to the first.

    The first bucket (the last layers, whose gradients come first) is capped at
    `first_bucket_bytes`, as DDP does, so that communication starts early in backward even
    when the cap is larger than the model. A parameter larger than the cap gets a bucket of
    its own; `bucket_bytes` <= 0 means one bucket for the whole model.
    """
    buckets: list[Bucket] = []
    current: list[nn.Parameter] = []
    size = 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        cap = min(bucket_bytes, first_bucket_bytes) if not buckets else bucket_bytes
        if current and bucket_bytes > 0 and size + nbytes > cap:
            buckets.append(_make_bucket(len(buckets), current, dtype))
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(_make_bucket(len(buckets), current, dtype))
    return buckets


def _make_bucket(index: int, params: list[nn.Parameter], dtype: torch.dtype | None) -> Bucket:
    buffer = torch.zeros(
        sum(p.numel() for p in params), dtype=dtype or params[0].dtype, device=params[0].device
    )
    views, offset = [], 0
    for p in params:
        views.append(buffer[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
    return Bucket(index, list(params), buffer, views)
