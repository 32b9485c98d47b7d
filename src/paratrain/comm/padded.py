"""gloo's native all-gather and reduce-scatter take equal pieces only: the pieces of
sharded.py's calls, which may differ between ranks, are padded to the longest here and
trimmed after. The ledger counts the unpadded bytes (sharded.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

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


def pad_chunks(flat: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, int]:
    """gloo reduce-scatters equal chunks only: pad each rank's chunk to the longest."""
    longest = max(sizes)
    if len(set(sizes)) == 1:
        return flat.contiguous(), longest
    padded = flat.new_zeros(longest * len(sizes))
    for dest, piece in zip(padded.split(longest), flat.split(sizes), strict=True):
        dest[: piece.numel()] = piece
    return padded, longest


def reduce_scatter_call(
    out: torch.Tensor, padded: torch.Tensor, op: str, group: CommGroup
) -> Callable[[], Any]:
    return lambda: compat.reduce_scatter_single(
        out, padded, op=NATIVE_OPS[op], group=group.pg, async_op=True
    )


def native_reduce_scatter_padded(
    flat: torch.Tensor, sizes: list[int], group: CommGroup, record: CallRecord, op: str
) -> torch.Tensor:
    padded, longest = pad_chunks(flat, sizes)
    out = flat.new_empty(longest)
    wait_works(
        group, record, ordering.issue(group, record, reduce_scatter_call(out, padded, op, group))
    )
    mine = out[: sizes[group.rank]].clone()
    if op == "avg":
        finish_avg_(mine, group.size)
    return mine
