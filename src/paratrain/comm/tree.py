"""Binomial-tree algorithms on point-to-point messages.

Ranks are renumbered relative to the root, v = (rank - root) mod k. In the reduction,
at round i a rank whose bit i is set sends its partial result to v - 2^i and leaves; the
others receive from v + 2^i (if it exists) and accumulate. The broadcast runs the same
tree downward. log2(k) rounds of whole-tensor messages: fewer steps than the ring (good for
small messages, latency-bound), but each non-root sends S in the reduction and every parent
sends S to each child in the broadcast, so per-rank bytes are uneven (see `tree_traffic`).
"""

from __future__ import annotations

import torch

from paratrain.comm.group import CommGroup
from paratrain.comm.ledger import CallRecord
from paratrain.comm.p2p import add, exchange
from paratrain.comm.reduction import combine_, finish_avg_
from paratrain.comm.traffic import Traffic


def _lowest_bit(v: int, size: int) -> int:
    """The subtree span of relative rank v: its lowest set bit, or past k for the root."""
    if v == 0:
        span = 1
        while span < size:
            span <<= 1
        return span
    return v & -v


def children(v: int, size: int) -> list[int]:
    """Relative ranks v + 2^i below v's lowest set bit that exist, nearest first."""
    out, mask = [], 1
    while mask < _lowest_bit(v, size):
        if v + mask < size:
            out.append(v + mask)
        mask <<= 1
    return out


def tree_traffic(nbytes: int, size: int, v: int, reduce: bool, broadcast: bool) -> Traffic:
    """What the tree structure implies for relative rank v (root is v = 0)."""
    sent = recv = messages = 0
    n_children = len(children(v, size))
    if reduce:
        sent += nbytes if v else 0
        messages += 1 if v else 0
        recv += nbytes * n_children
    if broadcast:
        recv += nbytes if v else 0
        sent += nbytes * n_children
        messages += n_children
    return Traffic(sent, recv, messages)


def reduce_(t: torch.Tensor, group: CommGroup, record: CallRecord, op: str, root: int) -> Traffic:
    """Afterwards the root's `t` holds the reduction; other ranks' `t` are partial sums."""
    k = group.size
    v = (group.rank - root) % k
    buffer = torch.empty_like(t)
    traffic = Traffic(0, 0, 0)
    for child in children(v, k):
        traffic = add(traffic, exchange(group, record, [], [(buffer, (child + root) % k)]))
        combine_(t, buffer, op)
    if v:
        parent = (v - (v & -v) + root) % k
        traffic = add(traffic, exchange(group, record, [(t, parent)], []))
    elif op == "avg":
        finish_avg_(t, k)
    return traffic


def broadcast_(t: torch.Tensor, group: CommGroup, record: CallRecord, root: int) -> Traffic:
    k = group.size
    v = (group.rank - root) % k
    traffic = Traffic(0, 0, 0)
    if v:
        parent = (v - (v & -v) + root) % k
        traffic = add(traffic, exchange(group, record, [], [(t, parent)]))
    # Farthest child first: it has the largest subtree still to serve.
    for child in reversed(children(v, k)):
        traffic = add(traffic, exchange(group, record, [(t, (child + root) % k)], []))
    return traffic


def all_reduce_(t: torch.Tensor, group: CommGroup, record: CallRecord, op: str) -> Traffic:
    """Reduce up the tree to rank 0, then broadcast the result down the same tree."""
    return add(reduce_(t, group, record, op, root=0), broadcast_(t, group, record, root=0))
