"""PowerSGD's rank-r approximation of the mean of a flat gradient over a group.

Vogels et al., "PowerSGD" (arXiv:1905.13727), algorithm 1: each matrix M (a parameter of
two or more dimensions, as rows x the rest) is replaced by P Q^T, with one step of power
iteration warm-started from the last step's Q (their section 3: "reuse"). Per matrix, on
every rank: P = M Q; P is averaged over the group; P is orthonormalised (a reduced QR,
Householder: orthonormal to rounding whatever P's conditioning); Q = M^T P, averaged.
Since the averages are linear, P Q^T is the projection of the group's mean of M onto the
span of P: at full rank (r = min(rows, cols)) the projection is the identity and P Q^T is
the exact mean up to rounding. The other elements (vectors: biases, norms' gains) are
averaged exactly in the first call, beside the P's: two all-reduces per flat buffer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Matrix:
    """A parameter of a flat buffer compressed as a matrix: elements [offset, offset +
    rows * cols) viewed as (rows, cols)."""

    offset: int
    rows: int
    cols: int

    @property
    def end(self) -> int:
        return self.offset + self.rows * self.cols


def matrices_of(shapes: list[tuple[int, torch.Size]], rank: int) -> list[Matrix]:
    """The tensors of a flat buffer, at (offset, shape), that PowerSGD approximates at
    `rank`: those of two or more dimensions, as (elements / last dimension, last
    dimension) (a linear layer's (out, in); stacked experts' (experts x out, in)), whose
    smaller side exceeds the rank. At a rank as large as the smaller side P Q^T is the
    exact mean (the module docstring), so such a matrix is averaged exactly instead, in
    no more bytes."""
    out = []
    for offset, s in shapes:
        if len(s) >= 2 and min(s.numel() // s[-1], s[-1]) > rank:
            out.append(Matrix(offset, s.numel() // s[-1], s[-1]))
    return out


def exact_ranges(numel: int, matrices: list[Matrix]) -> list[tuple[int, int]]:
    """The ranges of a flat buffer of `numel` elements outside every matrix."""
    ranges, at = [], 0
    for m in sorted(matrices, key=lambda m: m.offset):
        if m.offset > at:
            ranges.append((at, m.offset))
        at = m.end
    if at < numel:
        ranges.append((at, numel))
    return ranges


def first_factors(
    matrices: list[Matrix], rank: int, seed: int, device: torch.device
) -> list[torch.Tensor]:
    """The starting Q of each matrix, (cols, rank) standard normal from `seed`: the same on
    every rank of a group, as the algorithm needs (drawn on the CPU, whose generator gives
    the same numbers on every machine, then moved)."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    draws = [torch.randn(m.cols, rank, generator=generator, device="cpu") for m in matrices]
    return [q.to(device) for q in draws]


def powersgd_mean(
    v: torch.Tensor,
    matrices: list[Matrix],
    factors: list[torch.Tensor],
    mean: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """The approximate group mean of flat `v`: P Q^T for each matrix, the exact mean
    elsewhere. `factors` (each matrix's Q) are replaced in place by the averaged new Q,
    the next step's warm start; `mean(t)` averages t over the group, in place."""
    ms = [v[m.offset : m.end].view(m.rows, m.cols) for m in matrices]
    exact = exact_ranges(v.numel(), matrices)
    ps = [m @ q for m, q in zip(ms, factors, strict=True)]
    first = mean(torch.cat([p.reshape(-1) for p in ps] + [v[a:b] for a, b in exact]))
    out = torch.empty_like(v)
    at = 0
    for p in ps:
        p.copy_(first[at : at + p.numel()].view_as(p))
        at += p.numel()
    for a, b in exact:
        out[a:b] = first[at : at + b - a]
        at += b - a
    if not matrices:  # every element averaged exactly: one call
        return out
    ps = [torch.linalg.qr(p, mode="reduced").Q for p in ps]
    second = mean(torch.cat([(m.T @ p).reshape(-1) for m, p in zip(ms, ps, strict=True)]))
    at = 0
    for m, p, q in zip(matrices, ps, factors, strict=True):
        q.copy_(second[at : at + q.numel()].view_as(q))
        at += q.numel()
        out[m.offset : m.end] = (p @ q.T).reshape(-1)
    return out
