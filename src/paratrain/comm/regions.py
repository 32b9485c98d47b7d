"""Differentiable collectives: the seams between replicated and split tensor-parallel regions.

Megatron-LM (Shoeybi et al., arXiv:1909.08053, section 3) names two conjugate operators:

- `f`: identity in forward, all-reduce in backward. Placed where a replicated activation
  enters a split region (before column-parallel layers): every rank computes with the same
  input, so in backward each rank holds only its part of dL/dx and the parts are summed.
- `g`: all-reduce in forward, identity in backward. Placed where partial results leave a
  split region (after a row-parallel layer): the sum is the layer's output, and its
  gradient is already whole on every rank.

Sequence parallelism (Korthikanti et al., arXiv:2205.05198, section 4.2.2) replaces them by
another conjugate pair along the sequence dimension, each moving half an all-reduce:
`gather_sequence` (all-gather forward, reduce-scatter backward; the paper's g) and
`reduce_scatter_sequence` (reduce-scatter forward, all-gather backward; its g-bar).
`gather_slices` and `split` along any dimension complete the set (a column-parallel output
gathered on request, an input split for a row-parallel layer).

Every collective goes through `paratrain.comm`, so the ledger counts it; a group of one
rank skips the collective entirely (the functions return their input). Compiled blocks
(--compile) break their graph at each of these seams and run it eagerly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch

from paratrain import comm
from paratrain.comm.compat import graph_break
from paratrain.comm.group import CommGroup

# ---- plain (non-differentiable) helpers along a dimension -------------------------------


def _all_reduce(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    # A copy: the input of an autograd function (or a gradient handed to backward) may be
    # used elsewhere, so it is never reduced in place.
    out = x.contiguous().clone()
    comm.all_reduce(out, group, op="sum")
    return out


def _check_divisible(x: torch.Tensor, dim: int, group: CommGroup, what: str) -> int:
    size = x.shape[dim]
    if size % group.size:
        raise ValueError(
            f"cannot {what} dimension {dim} of shape {list(x.shape)} over tp={group.size}: "
            f"{size} is not divisible by {group.size}"
        )
    return size // group.size


def _split(x: torch.Tensor, dim: int, group: CommGroup) -> torch.Tensor:
    """This rank's contiguous chunk of x along dim; no communication."""
    n = _check_divisible(x, dim, group, "split")
    return x.narrow(dim, group.rank * n, n).contiguous()


def _gather(x: torch.Tensor, dim: int, group: CommGroup) -> torch.Tensor:
    """Concatenate every rank's x along dim, in rank order (all ranks hold equal shapes)."""
    # all_gather_flat concatenates flat tensors, so the gathered dimension is moved to the
    # front first: then rank r's chunk is one contiguous run of the result.
    front = x.movedim(dim, 0).contiguous()  # (n, ...)
    flat = comm.all_gather_flat(front, group, sizes=[front.numel()] * group.size)
    full = flat.view(group.size * front.shape[0], *front.shape[1:])  # (k * n, ...)
    return full.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group: CommGroup) -> torch.Tensor:
    """Sum x over the group and keep this rank's chunk along dim."""
    n = _check_divisible(x, dim, group, "reduce-scatter")
    front = x.movedim(dim, 0).contiguous()  # (k * n, ...): chunk r is rank r's slice
    mine = comm.reduce_scatter(front, group, op="sum")
    return mine.view(n, *front.shape[1:]).movedim(0, dim).contiguous()


# ---- autograd functions -----------------------------------------------------------------
# torch leaves `Function.apply` unannotated: each class declares it with forward's arguments.


class _CopyToRegion(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce backward."""

    apply: ClassVar[Callable[[torch.Tensor, CommGroup], torch.Tensor]]  # forward's args

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: CommGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)  # a view, so autograd records this node without copying

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward."""

    apply: ClassVar[Callable[[torch.Tensor, CommGroup], torch.Tensor]]  # forward's args

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: CommGroup) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _Gather(torch.autograd.Function):
    """All-gather forward; backward keeps this rank's slice of the gradient."""

    apply: ClassVar[Callable[[torch.Tensor, int, CommGroup], torch.Tensor]]

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: CommGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _gather(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _split(grad, ctx.dim, ctx.group), None, None


class _Split(torch.autograd.Function):
    """Keep this rank's slice forward; backward all-gathers the gradient."""

    apply: ClassVar[Callable[[torch.Tensor, int, CommGroup], torch.Tensor]]

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: CommGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _gather(grad, ctx.dim, ctx.group), None, None


class _GatherSequence(torch.autograd.Function):
    """Sequence parallel g: all-gather forward, reduce-scatter backward."""

    apply: ClassVar[Callable[[torch.Tensor, int, CommGroup], torch.Tensor]]

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: CommGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _gather(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        # Each rank's consumers (column-parallel layers) produced a partial dL/dx for the
        # whole sequence; summing and keeping the local chunk is f's all-reduce, halved.
        return _reduce_scatter(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterSequence(torch.autograd.Function):
    """Sequence parallel g-bar: reduce-scatter forward, all-gather backward."""

    apply: ClassVar[Callable[[torch.Tensor, int, CommGroup], torch.Tensor]]

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: CommGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _gather(grad, ctx.dim, ctx.group), None, None


# ---- public functions -------------------------------------------------------------------
# Each is disabled for dynamo (compat.graph_break): under --compile a seam is a
# deliberate graph break and its collective runs eagerly through the ledger
# (parallel/compile.py says why).


@graph_break
def f(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """Enter a split region: identity forward, all-reduce of the gradient in backward."""
    return x if group.size == 1 else _CopyToRegion.apply(x, group)


@graph_break
def g(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """Leave a split region: all-reduce the partial outputs forward, identity backward."""
    return x if group.size == 1 else _ReduceFromRegion.apply(x, group)


@graph_break
def gather_slices(x: torch.Tensor, group: CommGroup, dim: int = -1) -> torch.Tensor:
    """Concatenate the ranks' slices along dim; backward keeps the local slice."""
    return x if group.size == 1 else _Gather.apply(x, dim, group)


@graph_break
def split(x: torch.Tensor, group: CommGroup, dim: int = -1) -> torch.Tensor:
    """Keep this rank's slice along dim (no traffic); backward all-gathers the gradient."""
    return x if group.size == 1 else _Split.apply(x, dim, group)


@graph_break
def gather_sequence(x: torch.Tensor, group: CommGroup, dim: int = -2) -> torch.Tensor:
    """Leave a sequence-parallel region: all-gather forward, reduce-scatter backward.

    `dim` is the sequence dimension; activations here are (B, T, C), so it is -2.
    """
    return x if group.size == 1 else _GatherSequence.apply(x, dim, group)


@graph_break
def reduce_scatter_sequence(x: torch.Tensor, group: CommGroup, dim: int = -2) -> torch.Tensor:
    """Enter a sequence-parallel region from partial sums: reduce-scatter forward,
    all-gather backward."""
    return x if group.size == 1 else _ReduceScatterSequence.apply(x, dim, group)
