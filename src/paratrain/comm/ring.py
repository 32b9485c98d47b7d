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
from paratrain.comm.reduction import combine_, finish_avg_
from paratrain.comm.traffic import Traffic, chunk_sizes


def reduce_scatter_(
    flat: torch.Tensor, sizes: list[int], group: CommGroup, record: CallRecord, op: str
) -> Traffic:
    """In place on a 1-D tensor split into `sizes`: afterwards chunk `group.rank` is reduced."""
    k, r = group.size, group.rank
    chunks = list(flat.split(sizes))  # views; sizes may be uneven
    right, left = (r + 1) % k, (r - 1) % k
    buffer = flat.new_empty(max(sizes))
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
