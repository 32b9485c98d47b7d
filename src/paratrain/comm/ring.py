"""Ring algorithms on point-to-point messages (Patarasuk & Yuan 2009, as in NCCL and Horovod).

The flat tensor is split into k chunks (`traffic.chunk_sizes`); each rank talks only to its
neighbours, sending right and receiving left. Reduce-scatter leaves rank r with the full
reduction of chunk r after k - 1 steps; all-gather then circulates the finished chunks in
k - 1 more. All-reduce is the two in turn: 2 (k - 1) steps of S / k bytes each.
"""

from __future__ import annotations

import torch

from paratrain.comm.group import CommGroup
from paratrain.comm.ledger import CallRecord
from paratrain.comm.p2p import add, exchange
from paratrain.comm.reduction import combine_, combine_into, finish_avg_
from paratrain.comm.traffic import Traffic, chunk_sizes


def reduce_scatter_(
    flat: torch.Tensor, sizes: list[int], group: CommGroup, record: CallRecord, op: str
) -> Traffic:
    """In place on a 1-D tensor split into `sizes`: afterwards chunk `group.rank` is reduced."""
    k, r = group.size, group.rank
    chunks = list(flat.split(sizes))  # views; sizes may be uneven
    right, left = (r + 1) % k, (r - 1) % k
    buffer = group.scratch(max(sizes), flat.dtype, flat.device)
    traffic = Traffic(0, 0, 0)
    for step in range(k - 1):
        # Step s: pass on my partial sum of chunk r-s-1, receive the left one's of r-s-2.
        out_idx, in_idx = (r - step - 1) % k, (r - step - 2) % k
        incoming = buffer[: chunks[in_idx].numel()]
        traffic = add(
            traffic, exchange(group, record, [(chunks[out_idx], right)], [(incoming, left)])
        )
        combine_(chunks[in_idx], incoming, op)
    if op == "avg":
        finish_avg_(chunks[r], k)
    return traffic


def reduce_scatter_into(
    flat: torch.Tensor,
    sizes: list[int],
    out: torch.Tensor,
    group: CommGroup,
    record: CallRecord,
    op: str,
) -> Traffic:
    """The same steps and bytes as `reduce_scatter_`, leaving `flat` untouched: the running
    partial sum lives in `out` (at least the longest chunk), which ends holding chunk
    `group.rank`'s reduction in its first sizes[rank] elements. No copy of the input."""
    k, r = group.size, group.rank
    chunks = list(flat.split(sizes))
    right, left = (r + 1) % k, (r - 1) % k
    incoming = group.scratch(max(sizes), flat.dtype, flat.device)
    traffic = Traffic(0, 0, 0)
    for step in range(k - 1):
        # Step s sends the partial of chunk r-s-1: the input's own at s = 0, then the one
        # just accumulated; it receives the left one's partial of chunk r-s-2 and adds the
        # input's chunk to it. The send has completed when exchange returns.
        out_idx, in_idx = (r - step - 1) % k, (r - step - 2) % k
        sending = chunks[out_idx] if step == 0 else out[: sizes[out_idx]]
        received = incoming[: sizes[in_idx]]
        traffic = add(traffic, exchange(group, record, [(sending, right)], [(received, left)]))
        combine_into(out[: sizes[in_idx]], received, chunks[in_idx], op)
    if k == 1:
        out[: sizes[r]].copy_(chunks[r])
    if op == "avg":
        finish_avg_(out[: sizes[r]], k)
    return traffic


def all_gather_(
    flat: torch.Tensor, sizes: list[int], group: CommGroup, record: CallRecord
) -> Traffic:
    """In place on a 1-D tensor split into `sizes` whose chunk `group.rank` is valid."""
    k, r = group.size, group.rank
    chunks = list(flat.split(sizes))
    right, left = (r + 1) % k, (r - 1) % k
    traffic = Traffic(0, 0, 0)
    for step in range(k - 1):
        # Step s: forward chunk r-s (mine at s = 0, then what arrived), receive chunk r-s-1.
        out_idx, in_idx = (r - step) % k, (r - step - 1) % k
        traffic = add(
            traffic, exchange(group, record, [(chunks[out_idx], right)], [(chunks[in_idx], left)])
        )
    return traffic


def all_reduce_(flat: torch.Tensor, group: CommGroup, record: CallRecord, op: str) -> Traffic:
    sizes = chunk_sizes(flat.numel(), group.size)
    rs = reduce_scatter_(flat, sizes, group, record, op)
    return add(rs, all_gather_(flat, sizes, group, record))
