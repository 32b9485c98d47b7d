"""gloo's and NCCL's native all-gather and reduce-scatter take equal pieces only: the
pieces of sharded.py's calls, which may differ between ranks, are padded to the longest
here and trimmed after; a reduce-scatter of pieces that differ by more than one element
goes to their owners instead, one reduce each (`start_reduce_scatter`). The ledger counts
the unpadded bytes (sharded.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from paratrain.comm import compat, ordering
from paratrain.comm.group import CommGroup
from paratrain.comm.ledger import CallRecord
from paratrain.comm.reduction import NATIVE_OPS, finish_avg_
from paratrain.comm.wait import wait_works


def native_all_gather_padded(
    flat: torch.Tensor, sizes: list[int], out: torch.Tensor, group: CommGroup, record: CallRecord
) -> None:
    """gloo gathers equal sizes only: pad every piece to the largest, then trim."""
    if len(set(sizes)) == 1:
        mine = flat.contiguous()
        start = lambda: compat.all_gather_single(out, mine, group=group.pg, async_op=True)  # noqa: E731
        wait_works(group, record, ordering.issue(group, record, start))
        return
    longest = max(sizes)
    padded = flat.new_zeros(longest)
    padded[: flat.numel()] = flat
    gathered = flat.new_empty(longest * group.size)
    start = lambda: compat.all_gather_single(gathered, padded, group=group.pg, async_op=True)  # noqa: E731
    wait_works(group, record, ordering.issue(group, record, start))
    for piece, (n, dest) in zip(
        gathered.split(longest), zip(sizes, out.split(sizes), strict=True), strict=True
    ):
        dest.copy_(piece[:n])


def uneven(sizes: list[int]) -> bool:
    """Pieces more than one element apart: a reduce-scatter of them goes to their owners
    (`start_reduce_scatter`). Pieces cut by ceil(n / k) differ by one at most."""
    return max(sizes) - min(sizes) > 1


def start_reduce_scatter(
    flat: torch.Tensor, sizes: list[int], op: str, group: CommGroup, record: CallRecord
) -> tuple[list[Any], torch.Tensor]:
    """Start reducing `flat`'s pieces of `sizes`, piece r to group rank r; the works, and
    this rank's piece, its sum once they complete (avg: still to divide). `flat` stays
    untouched.

    Pieces of (nearly) equal size: the backend's reduce-scatter, each padded to the
    longest (gloo and NCCL take equal pieces only). Uneven ones, as the buckets of ZeRO-1
    and 2 are wherever a bucket lies mostly in one rank's shard: one reduce per rank that
    holds a piece, to that rank, as DeepSpeed's ZeRO-1 and 2 do. Padding such a bucket
    sent and held dp times its size (llama3-405b's rank 8191 at dp 64: docs/planner.md);
    the reduces send what a ring would, every piece but the rank's own."""
    if uneven(sizes):
        pieces = [piece.clone() for piece in flat.split(sizes)]  # the reduce's scratch
        works: list[Any] = []
        for owner, piece in enumerate(pieces):
            if piece.numel():
                works += ordering.issue(group, record, _reduce_call(piece, owner, op, group))
        return works, pieces[group.rank]
    longest = max(sizes)
    if len(set(sizes)) == 1:
        padded = flat.contiguous()
    else:
        padded = flat.new_zeros(longest * len(sizes))
        for dest, piece in zip(padded.split(longest), flat.split(sizes), strict=True):
            dest[: piece.numel()] = piece
    out = flat.new_empty(longest)
    call = lambda: compat.reduce_scatter_single(  # noqa: E731
        out, padded, op=NATIVE_OPS[op], group=group.pg, async_op=True
    )
    return ordering.issue(group, record, call), out[: sizes[group.rank]]


def _reduce_call(piece: torch.Tensor, owner: int, op: str, group: CommGroup) -> Callable[[], Any]:
    root = group.to_global(owner)
    return lambda: dist.reduce(piece, root, NATIVE_OPS[op], group=group.pg, async_op=True)


def native_reduce_scatter(
    flat: torch.Tensor, sizes: list[int], group: CommGroup, record: CallRecord, op: str
) -> torch.Tensor:
    """`start_reduce_scatter`, waited for: this rank's piece, a tensor of its own."""
    works, mine = start_reduce_scatter(flat, sizes, op, group, record)
    wait_works(group, record, works)
    if not uneven(sizes):
        mine = mine.clone()  # not a view that keeps the padded output alive
    if op == "avg":
        finish_avg_(mine, group.size)
    return mine
