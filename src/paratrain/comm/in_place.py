"""Collectives whose result lands in the caller's tensor: all_reduce, broadcast, reduce.

Each one is recorded, timed, bounded by a timeout and counted. Ranks (`src`, `dst`) are
relative to the group; `algo` chooses the algorithm per call (algos.py). A group of one
rank needs no communication: calls return at once and record nothing. avg is defined for
integers too (the sum divided by k, rounded down), which gloo lacks.
"""

from __future__ import annotations

from typing import Literal, overload

import torch
import torch.distributed as dist

from paratrain.comm import ordering, ring, tree
from paratrain.comm.algos import choose_algo
from paratrain.comm.call import Done, Handle, Pending, begin, describe, finish, issued, run_ours
from paratrain.comm.compat import same_memory
from paratrain.comm.group import CommGroup
from paratrain.comm.reduction import NATIVE_OPS, check_op, finish_avg_
from paratrain.comm.traffic import Traffic, chunk_sizes, native_traffic
from paratrain.comm.wait import wait_works


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _flat_work(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D view when the tensor is contiguous (so results land in place), else a copy."""
    return tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()


@overload
def all_reduce(
    tensor: torch.Tensor,
    group: CommGroup,
    op: str = ...,
    algo: str | None = ...,
    async_op: Literal[False] = ...,
) -> torch.Tensor: ...
@overload
def all_reduce(
    tensor: torch.Tensor,
    group: CommGroup,
    op: str = ...,
    algo: str | None = ...,
    *,
    async_op: Literal[True],
) -> Pending: ...
def all_reduce(
    tensor: torch.Tensor,
    group: CommGroup,
    op: str = "sum",
    algo: str | None = None,
    async_op: bool = False,
) -> torch.Tensor | Pending:
    """Reduce `tensor` in place over the group and return it (or a Handle if async_op)."""
    check_op(op)
    if group.size == 1:
        return Done(tensor) if async_op else tensor
    algo = choose_algo(group, algo, "all_reduce")
    record = begin(group, "all_reduce", algo, describe(tensor), overlapped=True)
    flat = _flat_work(tensor)
    sizes = [b * tensor.element_size() for b in chunk_sizes(tensor.numel(), group.size)]

    def done() -> torch.Tensor:
        if op == "avg" and algo == "native":
            finish_avg_(flat, group.size)
        if not same_memory(flat, tensor) or not tensor.is_contiguous():
            tensor.copy_(flat.view_as(tensor))
        return tensor

    if tensor.numel() == 0:
        finish(group, record, Traffic(0, 0, 0))
        return Done(tensor) if async_op else tensor
    if algo == "native":
        works = ordering.issue(
            group,
            record,
            lambda: dist.all_reduce(flat, op=NATIVE_OPS[op], group=group.pg, async_op=True),
        )
        traffic = native_traffic(
            "all_reduce", _nbytes(tensor), group.size, group.rank, chunk_bytes=sizes
        )
        return issued(Handle(group, record, works, traffic, then=done), async_op)
    algorithm = ring.all_reduce_ if algo == "ring" else tree.all_reduce_
    return run_ours(group, record, lambda: algorithm(flat, group, record, op), async_op, done)


def broadcast(
    tensor: torch.Tensor, group: CommGroup, src: int = 0, algo: str | None = None
) -> torch.Tensor:
    """Copy group rank `src`'s tensor into every rank's `tensor` (in place) and return it."""
    if group.size == 1:
        return tensor
    algo = choose_algo(group, algo, "broadcast")
    record = begin(group, "broadcast", algo, describe(tensor))
    flat = _flat_work(tensor)
    if tensor.numel() == 0:
        traffic = Traffic(0, 0, 0)
    elif algo == "native":
        # group_src: the group's own numbering, so that a group outside the default world
        # (fault tolerance's) needs no global rank
        start = lambda: dist.broadcast(flat, group=group.pg, group_src=src, async_op=True)  # noqa: E731
        wait_works(group, record, ordering.issue(group, record, start))
        traffic = native_traffic("broadcast", _nbytes(tensor), group.size, group.rank, src)
    else:
        run_ours(group, record, lambda: tree.broadcast_(flat, group, record, root=src), False)
        return _copy_back(flat, tensor)
    finish(group, record, traffic)
    return _copy_back(flat, tensor)


def reduce(
    tensor: torch.Tensor, group: CommGroup, dst: int = 0, op: str = "sum", algo: str | None = None
) -> torch.Tensor:
    """Reduce onto group rank `dst`, whose `tensor` then holds the result.

    Other ranks' `tensor` is used as scratch: its contents afterwards are unspecified.
    """
    check_op(op)
    if group.size == 1:
        return tensor
    algo = choose_algo(group, algo, "reduce")
    record = begin(group, "reduce", algo, describe(tensor))
    flat = _flat_work(tensor)
    if tensor.numel() == 0:
        traffic = Traffic(0, 0, 0)
    elif algo == "native":
        root, native_op = group.to_global(dst), NATIVE_OPS[op]
        start = lambda: dist.reduce(flat, root, native_op, group=group.pg, async_op=True)  # noqa: E731
        wait_works(group, record, ordering.issue(group, record, start))
        if op == "avg" and group.rank == dst:
            finish_avg_(flat, group.size)
        traffic = native_traffic("reduce", _nbytes(tensor), group.size, group.rank, dst)
    else:
        run_ours(group, record, lambda: tree.reduce_(flat, group, record, op, root=dst), False)
        return _copy_back(flat, tensor)
    finish(group, record, traffic)
    return _copy_back(flat, tensor)


def _copy_back(flat: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    if not same_memory(flat, tensor):
        tensor.copy_(flat.view_as(tensor))
    return tensor
