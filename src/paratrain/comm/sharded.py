"""Collectives between one whole tensor and per-rank shards: all_gather, reduce_scatter.

The pair that ZeRO and FSDP are built from. Each call is recorded, timed, bounded by a
timeout and counted; `algo` chooses the algorithm per call (algos.py). Shards may differ in
size between ranks, which gloo and NCCL do not support: all-gather of first dimensions that
differ and reduce-scatter of sizes k does not divide are padded to the longest shard
(padded.py) and trimmed, a reduce-scatter whose pieces differ by more than one element goes
to their owners, a reduce each, and the ledger counts the unpadded bytes. A group of one
rank records nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, overload

import torch

from paratrain.comm import compat, ordering, ring
from paratrain.comm.algos import choose_algo
from paratrain.comm.call import Done, Handle, Pending, begin, describe, finish, issued, run_ours
from paratrain.comm.group import CommGroup
from paratrain.comm.ledger import CallRecord
from paratrain.comm.p2p import add
from paratrain.comm.padded import (
    native_all_gather_padded,
    native_reduce_scatter,
    start_reduce_scatter,
    uneven,
)
from paratrain.comm.reduction import check_op, finish_avg_
from paratrain.comm.traffic import Traffic, chunk_sizes, native_traffic, owner_reduces
from paratrain.comm.wait import wait_works


@overload
def all_gather_flat(
    tensor: torch.Tensor,
    group: CommGroup,
    algo: str | None = ...,
    sizes: list[int] | None = ...,
    async_op: Literal[False] = ...,
    out: torch.Tensor | None = ...,
) -> torch.Tensor: ...
@overload
def all_gather_flat(
    tensor: torch.Tensor,
    group: CommGroup,
    algo: str | None = ...,
    sizes: list[int] | None = ...,
    *,
    async_op: Literal[True],
    out: torch.Tensor | None = ...,
) -> Pending: ...
def all_gather_flat(
    tensor: torch.Tensor,
    group: CommGroup,
    algo: str | None = None,
    sizes: list[int] | None = None,
    async_op: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor | Pending:
    """Concatenate every rank's flattened tensor, in rank order, into one 1-D tensor.

    `sizes` (elements per rank) may be given when every rank knows them; otherwise they are
    exchanged first (one small extra all-gather, counted). Sizes may differ between ranks.
    async_op returns a Handle whose wait() gives the result; it stays in flight when the
    sizes are known (and, on the native path, equal): what FSDP's prefetch needs; otherwise
    the call completes before it returns. `out` (contiguous, 1-D, of the total size; `tensor` may be
    its own rank's piece) receives the result instead of a new tensor: no second copy.
    """
    chosen = choose_algo(group, algo, "all_gather") if group.size > 1 else "native"
    if async_op and _can_overlap(group, chosen, sizes, tensor.numel()):
        assert sizes is not None
        record = begin(group, "all_gather", chosen, describe(tensor), overlapped=True)
        into = tensor.new_empty(sum(sizes)) if out is None else out
        if chosen == "ring":
            into.split(sizes)[group.rank].copy_(tensor.reshape(-1))
            gather = lambda: ring.all_gather_(into, sizes, group, record)  # noqa: E731
            return run_ours(group, record, gather, True, then=lambda: into)
        mine = tensor.reshape(-1).contiguous()
        works = ordering.issue(
            group,
            record,
            lambda: compat.all_gather_single(into, mine, group=group.pg, async_op=True),
        )
        chunk_bytes = [n * tensor.element_size() for n in sizes]
        traffic = native_traffic(
            "all_gather", sum(chunk_bytes), group.size, group.rank, chunk_bytes=chunk_bytes
        )
        return issued(Handle(group, record, works, traffic, result=into), True)
    result = _all_gather(tensor, group, algo, sizes, out)[0]
    return Done(result) if async_op else result


def _can_overlap(group: CommGroup, algo: str, sizes: list[int] | None, numel: int) -> bool:
    """Whether an async call can really be left in flight: sizes known (and, for gloo's
    native all-gather, equal), not empty."""
    return (
        group.size > 1
        and sizes is not None
        and len(sizes) == group.size
        and (algo == "ring" or len(set(sizes)) == 1)
        and sizes[group.rank] == numel
        and numel > 0
    )


def all_gather(
    tensor: torch.Tensor, group: CommGroup, algo: str | None = None
) -> list[torch.Tensor]:
    """Every rank's tensor, in rank order. Only the first dimension may differ between ranks."""
    flat, sizes = _all_gather(tensor, group, algo, None)
    inner = tuple(tensor.shape[1:])
    pieces = flat.split(sizes)
    if tensor.dim() == 0:
        return [p.view(()) for p in pieces]
    return [p.view(-1, *inner) for p in pieces]


def _all_gather(
    tensor: torch.Tensor,
    group: CommGroup,
    algo: str | None,
    sizes: list[int] | None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[int]]:
    if group.size == 1:
        if out is None:
            return tensor.reshape(-1).clone(), [tensor.numel()]
        return out.copy_(tensor.reshape(-1)), [tensor.numel()]
    algo = choose_algo(group, algo, "all_gather")
    record = begin(group, "all_gather", algo, describe(tensor))
    meta = Traffic(0, 0, 0)
    if sizes is None:
        sizes, meta = _exchange_sizes(tensor, group, record)
    elif len(sizes) != group.size or sizes[group.rank] != tensor.numel():
        raise ValueError(
            f"all_gather sizes {sizes} do not fit group {group.name} of {group.size} ranks "
            f"where rank {group.rank} holds {tensor.numel()} elements"
        )
    if out is None:
        out = tensor.new_empty(sum(sizes))
    elif out.numel() != sum(sizes) or not out.is_contiguous():
        raise ValueError(f"all_gather into {tuple(out.shape)}: needs {sum(sizes)} contiguous")
    chunk_bytes = [n * tensor.element_size() for n in sizes]
    if sum(sizes) == 0:
        traffic = Traffic(0, 0, 0)
    elif algo == "ring":
        out.split(sizes)[group.rank].copy_(tensor.reshape(-1))
        gather = lambda: add(ring.all_gather_(out, sizes, group, record), meta)  # noqa: E731
        run_ours(group, record, gather, False)
        return out, sizes
    else:
        native_all_gather_padded(tensor.reshape(-1), sizes, out, group, record)
        traffic = native_traffic(
            "all_gather", sum(chunk_bytes), group.size, group.rank, chunk_bytes=chunk_bytes
        )
    finish(group, record, add(traffic, meta))
    return out, sizes


def _exchange_sizes(
    tensor: torch.Tensor, group: CommGroup, record: CallRecord
) -> tuple[list[int], Traffic]:
    """Every rank's element count, exchanged where the tensors live (the group's backend)."""
    mine = torch.tensor([tensor.numel()], dtype=torch.int64, device=tensor.device)
    everyone = torch.empty(group.size, dtype=torch.int64, device=tensor.device)
    start = lambda: compat.all_gather_single(everyone, mine, group=group.pg, async_op=True)  # noqa: E731
    wait_works(group, record, ordering.issue(group, record, start))
    traffic = native_traffic("all_gather", 8 * group.size, group.size, group.rank)
    return [int(n) for n in everyone], traffic


@overload
def reduce_scatter(
    tensor: torch.Tensor,
    group: CommGroup,
    op: str = ...,
    algo: str | None = ...,
    sizes: list[int] | None = ...,
    async_op: Literal[False] = ...,
) -> torch.Tensor: ...
@overload
def reduce_scatter(
    tensor: torch.Tensor,
    group: CommGroup,
    op: str = ...,
    algo: str | None = ...,
    sizes: list[int] | None = ...,
    *,
    async_op: Literal[True],
) -> Pending: ...
def reduce_scatter(
    tensor: torch.Tensor,
    group: CommGroup,
    op: str = "sum",
    algo: str | None = None,
    sizes: list[int] | None = None,
    async_op: bool = False,
) -> torch.Tensor | Pending:
    """Reduce the flattened `tensor` over the group; return this rank's chunk of the result.

    Chunks follow `sizes` (elements per rank; default `chunk_sizes(numel, k)`, the first
    numel % k chunks one element longer). The input is not modified (nor may it be while
    an async call is in flight). async_op returns a Handle, in flight (ZeRO-2's overlap
    with backward): the native call in the backend, our ring on the group's thread.
    """
    if async_op:
        return _reduce_scatter_async(tensor, group, op, algo, sizes)
    check_op(op)
    flat = tensor.reshape(-1)
    sizes = sizes if sizes is not None else chunk_sizes(flat.numel(), group.size)
    if len(sizes) != group.size or sum(sizes) != flat.numel():
        raise ValueError(
            f"reduce_scatter sizes {sizes} must be {group.size} numbers adding up to "
            f"the tensor's {flat.numel()} elements"
        )
    if group.size == 1:
        return flat.clone()
    algo = choose_algo(group, algo, "reduce_scatter")
    record = begin(group, "reduce_scatter", algo, describe(tensor))
    if flat.numel() == 0:
        finish(group, record, Traffic(0, 0, 0))
        return flat.clone()
    if algo == "ring":
        call, then = _ring_reduce_scatter(flat, sizes, group, record, op)
        return run_ours(group, record, call, False, then=then)
    mine = native_reduce_scatter(flat, sizes, group, record, op)
    finish(group, record, _reduce_scatter_traffic(sizes, tensor.element_size(), group.rank))
    return mine


def _reduce_scatter_async(
    tensor: torch.Tensor, group: CommGroup, op: str, algo: str | None, sizes: list[int] | None
) -> Pending:
    flat = tensor.reshape(-1)
    sizes = sizes if sizes is not None else chunk_sizes(flat.numel(), group.size)
    if group.size == 1 or flat.numel() == 0:
        return Done(reduce_scatter(tensor, group, op, algo, sizes))
    check_op(op)
    if len(sizes) != group.size or sum(sizes) != flat.numel():
        raise ValueError(
            f"reduce_scatter sizes {sizes} must be {group.size} numbers adding up to "
            f"the tensor's {flat.numel()} elements"
        )
    chosen = choose_algo(group, algo, "reduce_scatter")
    record = begin(group, "reduce_scatter", chosen, describe(tensor), overlapped=True)
    if chosen == "ring":
        call, then = _ring_reduce_scatter(flat, sizes, group, record, op)
        return run_ours(group, record, call, True, then=then)
    works, mine = start_reduce_scatter(flat, sizes, op, group, record)
    traffic = _reduce_scatter_traffic(sizes, tensor.element_size(), group.rank)

    def done() -> torch.Tensor:
        if op == "avg":
            finish_avg_(mine, group.size)
        return mine

    return issued(Handle(group, record, works, traffic, then=done), True)


def _reduce_scatter_traffic(sizes: list[int], element_size: int, rank: int) -> Traffic:
    """A native reduce-scatter's traffic: a ring's, or with uneven pieces one reduce per
    owner (padded.py), which sends and receives the same bytes in fewer messages."""
    chunk_bytes = [n * element_size for n in sizes]
    if uneven(sizes):
        return owner_reduces(chunk_bytes, rank)
    return native_traffic(
        "reduce_scatter", sum(chunk_bytes), len(sizes), rank, chunk_bytes=chunk_bytes
    )


def _ring_reduce_scatter(
    flat: torch.Tensor, sizes: list[int], group: CommGroup, record: CallRecord, op: str
) -> tuple[Callable[[], Traffic], Callable[[], torch.Tensor]]:
    """Our ring's call and its result: the input stays untouched; the partial sums run in
    this rank's result."""
    out = flat.new_empty(max(sizes))
    call = lambda: ring.reduce_scatter_into(flat, sizes, out, group, record, op)  # noqa: E731
    return call, lambda: out[: sizes[group.rank]]
