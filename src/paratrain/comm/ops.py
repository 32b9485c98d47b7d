"""Collectives over a CommGroup, each one timed and counted in the group's ledger.

A group of one rank needs no communication: the call returns at once and records nothing.
A collective that fails (a peer died, or the group's timeout expired) raises CommError
naming the rank, the group, the op and its sequence number.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from paratrain.comm.group import CommGroup
from paratrain.comm.ledger import native_traffic

REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,  # gloo lacks AVG: sum, then divide by the group size
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


class CommError(RuntimeError):
    pass


def _fail(group: CommGroup, op: str, seq: int, nbytes: int, err: Exception) -> CommError:
    return CommError(
        f"rank {group.global_rank} (rank {group.rank} of group {group.name!r}, "
        f"ranks {group.ranks}): {op} #{seq} of {nbytes} bytes failed: {err}"
    )


def all_reduce(tensor: torch.Tensor, group: CommGroup, op: str = "sum") -> torch.Tensor:
    """Reduce `tensor` in place over the group (sum, avg, max or min) and return it."""
    if op not in REDUCE_OPS:
        raise ValueError(f"reduce op {op!r}; valid: {', '.join(REDUCE_OPS)}")
    if group.size == 1:
        return tensor
    nbytes = tensor.numel() * tensor.element_size()
    seq = group.ledger.next_seq()
    start = time.perf_counter()
    try:
        dist.all_reduce(tensor, op=REDUCE_OPS[op], group=group.pg)
    except RuntimeError as e:
        raise _fail(group, "all_reduce", seq, nbytes, e) from e
    sent, recv = native_traffic("all_reduce", nbytes, group.size)
    group.ledger.record("all_reduce", group.name, sent, recv, 2 * (group.size - 1), start, seq=seq)
    if op == "avg":
        if tensor.is_floating_point():
            tensor.div_(group.size)
        else:
            tensor.floor_divide_(group.size)
    return tensor


def broadcast(tensor: torch.Tensor, group: CommGroup, src: int = 0) -> torch.Tensor:
    """Copy group rank `src`'s tensor into every rank's `tensor` (in place) and return it."""
    if group.size == 1:
        return tensor
    nbytes = tensor.numel() * tensor.element_size()
    seq = group.ledger.next_seq()
    start = time.perf_counter()
    try:
        dist.broadcast(tensor, src=group.to_global(src), group=group.pg)
    except RuntimeError as e:
        raise _fail(group, "broadcast", seq, nbytes, e) from e
    sent, recv = native_traffic("broadcast", nbytes, group.size, is_root=group.rank == src)
    group.ledger.record("broadcast", group.name, sent, recv, group.size - 1, start, seq=seq)
    return tensor


def broadcast_object(obj: Any, group: CommGroup, src: int = 0) -> Any:
    """Broadcast a small picklable object (a path, a config) from group rank `src`."""
    if group.size == 1:
        return obj
    holder = [obj]
    seq = group.ledger.next_seq()
    start = time.perf_counter()
    try:
        dist.broadcast_object_list(holder, src=group.to_global(src), group=group.pg)
    except RuntimeError as e:
        raise _fail(group, "broadcast_object", seq, 0, e) from e
    group.ledger.record("broadcast_object", group.name, 0, 0, group.size - 1, start, seq=seq)
    return holder[0]
