"""Collectives over a CommGroup: each one recorded, timed, bounded by a timeout and counted.

Ranks (`src`, `dst`) are relative to the group. `algo` chooses the algorithm per call,
defaulting to the group's option: `native` is the backend's own collective (the fast path),
`ring` and `tree` are ours, built on point-to-point messages (ring.py, tree.py).

A group of one rank needs no communication: calls return at once and record nothing.
Gaps in gloo are filled here rather than passed on as errors: all-gather of tensors whose
first dimension differs between ranks, reduce-scatter of sizes k does not divide, and avg
on integers (the sum divided by k, rounded down).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from paratrain.comm import ring, tree
from paratrain.comm.call import Done, Handle, begin, describe, finish, wait_works
from paratrain.comm.group import CommGroup
from paratrain.comm.p2p import add
from paratrain.comm.reduction import check_op, finish_avg_
from paratrain.comm.traffic import Traffic, chunk_sizes, native_traffic

OUR_ALGOS = {
    "all_reduce": ("native", "ring", "tree"),
    "reduce_scatter": ("native", "ring"),
    "all_gather": ("native", "ring"),
    "broadcast": ("native", "tree"),
    "reduce": ("native", "tree"),
}
NATIVE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,  # then divided here: defined for integers too
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


def _algo(group: CommGroup, algo: str | None, op: str) -> str:
    chosen = algo or group.options.algo
    valid = OUR_ALGOS.get(op, ("native",))
    if chosen not in valid:
        if algo is None:  # a run-wide default that this op lacks: use the backend's own
            return "native"
        raise ValueError(f"{op} has no {chosen!r} algorithm; valid: {', '.join(valid)}")
    return chosen


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _flat_work(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D view when the tensor is contiguous (so results land in place), else a copy."""
    return tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()


def all_reduce(
    tensor: torch.Tensor,
    group: CommGroup,
    op: str = "sum",
    algo: str | None = None,
    async_op: bool = False,
) -> torch.Tensor | Handle:
    """Reduce `tensor` in place over the group and return it (or a Handle if async_op)."""
    check_op(op)
    if group.size == 1:
        return Done(tensor) if async_op else tensor
    algo = _algo(group, algo, "all_reduce")
    record = begin(group, "all_reduce", algo, describe(tensor))
    flat = _flat_work(tensor)
    sizes = [b * tensor.element_size() for b in chunk_sizes(tensor.numel(), group.size)]

    def done() -> torch.Tensor:
        if op == "avg" and algo == "native":
            finish_avg_(flat, group.size)
        if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
            tensor.copy_(flat.view_as(tensor))
        return tensor

    if tensor.numel() == 0:
        return _finish_now(group, record, Traffic(0, 0, 0), tensor, async_op)
    if algo == "native":
        work = dist.all_reduce(flat, op=NATIVE_OPS[op], group=group.pg, async_op=True)
        traffic = native_traffic(
            "all_reduce", _nbytes(tensor), group.size, group.rank, chunk_bytes=sizes
        )
        handle = Handle(group, record, [work], traffic, then=done)
        return handle if async_op else handle.wait()
    if algo == "ring":
        traffic = ring.all_reduce_(flat, group, record, op)
    else:
        traffic = tree.all_reduce_(flat, group, record, op)
    return _finish_now(group, record, traffic, done(), async_op)


def broadcast(
    tensor: torch.Tensor, group: CommGroup, src: int = 0, algo: str | None = None
) -> torch.Tensor:
    """Copy group rank `src`'s tensor into every rank's `tensor` (in place) and return it."""
    if group.size == 1:
        return tensor
    algo = _algo(group, algo, "broadcast")
    root = group.to_global(src)
    record = begin(group, "broadcast", algo, describe(tensor))
    flat = _flat_work(tensor)
    if tensor.numel() == 0:
        traffic = Traffic(0, 0, 0)
    elif algo == "native":
        wait_works(group, record, [dist.broadcast(flat, src=root, group=group.pg, async_op=True)])
        traffic = native_traffic("broadcast", _nbytes(tensor), group.size, group.rank, src)
    else:
        traffic = tree.broadcast_(flat, group, record, root=src)
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))
    finish(group, record, traffic)
    return tensor


def reduce(
    tensor: torch.Tensor, group: CommGroup, dst: int = 0, op: str = "sum", algo: str | None = None
) -> torch.Tensor:
    """Reduce onto group rank `dst`, whose `tensor` then holds the result.

    Other ranks' `tensor` is used as scratch: its contents afterwards are unspecified.
    """
    check_op(op)
    if group.size == 1:
        return tensor
    algo = _algo(group, algo, "reduce")
    record = begin(group, "reduce", algo, describe(tensor))
    flat = _flat_work(tensor)
    if tensor.numel() == 0:
        traffic = Traffic(0, 0, 0)
    elif algo == "native":
        work = dist.reduce(
            flat, dst=group.to_global(dst), op=NATIVE_OPS[op], group=group.pg, async_op=True
        )
        wait_works(group, record, [work])
        if op == "avg" and group.rank == dst:
            finish_avg_(flat, group.size)
        traffic = native_traffic("reduce", _nbytes(tensor), group.size, group.rank, dst)
    else:
        traffic = tree.reduce_(flat, group, record, op, root=dst)
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))
    finish(group, record, traffic)
    return tensor


def all_gather_flat(
    tensor: torch.Tensor,
    group: CommGroup,
    algo: str | None = None,
    sizes: list[int] | None = None,
    async_op: bool = False,
) -> torch.Tensor | Handle:
    """Concatenate every rank's flattened tensor, in rank order, into one 1-D tensor.

    `sizes` (elements per rank) may be given when every rank knows them; otherwise they are
    exchanged first (one small extra all-gather, counted). Sizes may differ between ranks.
    async_op returns a Handle whose wait() gives the result; it stays in flight only on the
    native path with equal, known sizes (what FSDP's prefetch needs); otherwise the call
    completes before it returns.
    """
    if async_op and _can_overlap(group, algo, "all_gather", sizes, tensor.numel()):
        assert sizes is not None
        record = begin(group, "all_gather", "native", describe(tensor))
        out = torch.empty(sum(sizes), dtype=tensor.dtype)
        work = dist.all_gather_single(
            out, tensor.reshape(-1).contiguous(), group=group.pg, async_op=True
        )
        chunk_bytes = [n * tensor.element_size() for n in sizes]
        traffic = native_traffic(
            "all_gather", sum(chunk_bytes), group.size, group.rank, chunk_bytes=chunk_bytes
        )
        return Handle(group, record, [work], traffic, result=out)
    result = _all_gather(tensor, group, algo, sizes)[0]
    return Done(result) if async_op else result


def _can_overlap(
    group: CommGroup, algo: str | None, op: str, sizes: list[int] | None, numel: int
) -> bool:
    """Whether an async call can really be left in flight: native, equal sizes, not empty."""
    return (
        group.size > 1
        and _algo(group, algo, op) == "native"
        and sizes is not None
        and len(sizes) == group.size
        and len(set(sizes)) == 1
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
    tensor: torch.Tensor, group: CommGroup, algo: str | None, sizes: list[int] | None
) -> tuple[torch.Tensor, list[int]]:
    if group.size == 1:
        return tensor.reshape(-1).clone(), [tensor.numel()]
    algo = _algo(group, algo, "all_gather")
    record = begin(group, "all_gather", algo, describe(tensor))
    meta = Traffic(0, 0, 0)
    if sizes is None:
        sizes, meta = _exchange_sizes(tensor.numel(), group, record)
    elif len(sizes) != group.size or sizes[group.rank] != tensor.numel():
        raise ValueError(
            f"all_gather sizes {sizes} do not fit group {group.name} of {group.size} ranks "
            f"where rank {group.rank} holds {tensor.numel()} elements"
        )
    out = torch.empty(sum(sizes), dtype=tensor.dtype)
    chunk_bytes = [n * tensor.element_size() for n in sizes]
    if sum(sizes) == 0:
        traffic = Traffic(0, 0, 0)
    elif algo == "ring":
        out.split(sizes)[group.rank].copy_(tensor.reshape(-1))
        traffic = ring.all_gather_(out, sizes, group, record)
    else:
        _native_all_gather_padded(tensor.reshape(-1), sizes, out, group, record)
        traffic = native_traffic(
            "all_gather", sum(chunk_bytes), group.size, group.rank, chunk_bytes=chunk_bytes
        )
    finish(group, record, add(traffic, meta))
    return out, sizes


def _exchange_sizes(numel: int, group: CommGroup, record) -> tuple[list[int], Traffic]:
    mine = torch.tensor([numel], dtype=torch.int64)
    everyone = torch.empty(group.size, dtype=torch.int64)
    work = dist.all_gather_single(everyone, mine, group=group.pg, async_op=True)
    wait_works(group, record, [work])
    traffic = native_traffic("all_gather", 8 * group.size, group.size, group.rank)
    return [int(n) for n in everyone], traffic


def _native_all_gather_padded(flat, sizes, out, group, record) -> None:
    """gloo gathers equal sizes only: pad every piece to the largest, then trim."""
    if len(set(sizes)) == 1:
        work = dist.all_gather_single(out, flat.contiguous(), group=group.pg, async_op=True)
        wait_works(group, record, [work])
        return
    longest = max(sizes)
    padded = torch.zeros(longest, dtype=flat.dtype)
    padded[: flat.numel()] = flat
    gathered = torch.empty(longest * group.size, dtype=flat.dtype)
    work = dist.all_gather_single(gathered, padded, group=group.pg, async_op=True)
    wait_works(group, record, [work])
    for piece, (n, dest) in zip(
        gathered.split(longest), zip(sizes, out.split(sizes), strict=True), strict=True
    ):
        dest.copy_(piece[:n])


def reduce_scatter(
    tensor: torch.Tensor,
    group: CommGroup,
    op: str = "sum",
    algo: str | None = None,
    sizes: list[int] | None = None,
    async_op: bool = False,
) -> torch.Tensor | Handle:
    """Reduce the flattened `tensor` over the group; return this rank's chunk of the result.

    Chunks follow `sizes` (elements per rank; default `chunk_sizes(numel, k)`, the first
    numel % k chunks one element longer). The input is not modified (nor may it be while
    an async call is in flight). async_op returns a Handle: the native path stays in flight
    (ZeRO-2's overlap with backward); our ring completes before it returns.
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
    algo = _algo(group, algo, "reduce_scatter")
    record = begin(group, "reduce_scatter", algo, describe(tensor))
    chunk_bytes = [n * tensor.element_size() for n in sizes]
    if flat.numel() == 0:
        finish(group, record, Traffic(0, 0, 0))
        return flat.clone()
    if algo == "ring":
        work = flat.clone()
        traffic = ring.reduce_scatter_(work, sizes, group, record, op)
        mine = work.split(sizes)[group.rank].clone()
    else:
        mine = _native_reduce_scatter_padded(flat, sizes, group, record, op)
        traffic = native_traffic(
            "reduce_scatter", sum(chunk_bytes), group.size, group.rank, chunk_bytes=chunk_bytes
        )
    finish(group, record, traffic)
    return mine


def _reduce_scatter_async(tensor, group, op, algo, sizes) -> Handle | Done:
    flat = tensor.reshape(-1)
    sizes = sizes if sizes is not None else chunk_sizes(flat.numel(), group.size)
    if group.size == 1 or flat.numel() == 0 or _algo(group, algo, "reduce_scatter") != "native":
        return Done(reduce_scatter(tensor, group, op, algo, sizes))
    check_op(op)
    if len(sizes) != group.size or sum(sizes) != flat.numel():
        raise ValueError(
            f"reduce_scatter sizes {sizes} must be {group.size} numbers adding up to "
            f"the tensor's {flat.numel()} elements"
        )
    record = begin(group, "reduce_scatter", "native", describe(tensor))
    padded, longest = _pad_chunks(flat, sizes)
    out = torch.empty(longest, dtype=flat.dtype)
    work = dist.reduce_scatter_single(out, padded, op=NATIVE_OPS[op], group=group.pg, async_op=True)
    chunk_bytes = [n * tensor.element_size() for n in sizes]
    traffic = native_traffic(
        "reduce_scatter", sum(chunk_bytes), group.size, group.rank, chunk_bytes=chunk_bytes
    )

    def done() -> torch.Tensor:
        mine = out[: sizes[group.rank]]
        if op == "avg":
            finish_avg_(mine, group.size)
        return mine

    return Handle(group, record, [work], traffic, then=done)


def _pad_chunks(flat: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, int]:
    """gloo reduce-scatters equal chunks only: pad each rank's chunk to the longest."""
    longest = max(sizes)
    if len(set(sizes)) == 1:
        return flat.contiguous(), longest
    padded = torch.zeros(longest * len(sizes), dtype=flat.dtype)
    for dest, piece in zip(padded.split(longest), flat.split(sizes), strict=True):
        dest[: piece.numel()] = piece
    return padded, longest


def _native_reduce_scatter_padded(flat, sizes, group, record, op) -> torch.Tensor:
    padded, longest = _pad_chunks(flat, sizes)
    out = torch.empty(longest, dtype=flat.dtype)
    work = dist.reduce_scatter_single(out, padded, op=NATIVE_OPS[op], group=group.pg, async_op=True)
    wait_works(group, record, [work])
    mine = out[: sizes[group.rank]].clone()
    if op == "avg":
        finish_avg_(mine, group.size)
    return mine


def _finish_now(group, record, traffic, result, async_op):
    finish(group, record, traffic)
    return Done(result) if async_op else result
