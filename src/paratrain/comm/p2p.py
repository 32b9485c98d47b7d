"""Point-to-point messages: the public send/recv, and the exchange our algorithms build on.

Ranks are relative to the group. The public calls are recorded in the ledger like any op;
`exchange`, used inside ring and tree algorithms, is not recorded on its own: its bytes
count toward the collective that uses it.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

from paratrain.comm import ordering
from paratrain.comm.call import Handle, begin, describe
from paratrain.comm.group import CommGroup
from paratrain.comm.ledger import CallRecord
from paratrain.comm.traffic import Traffic
from paratrain.comm.wait import Work, hold_until, wait_works

ALGORITHM_TAGS = 0x7A160000  # + 16 bits of a group's name: never 0, the public calls' tag


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _check_peer(group: CommGroup, peer: int, what: str) -> int:
    if peer == group.rank:
        raise ValueError(f"{what} {peer} is this rank itself in group {group.name}")
    return group.to_global(peer)


def isend(tensor: torch.Tensor, group: CommGroup, dst: int) -> Handle[torch.Tensor]:
    """Start sending `tensor` to group rank `dst`; wait() on the handle before reusing it."""
    peer = _check_peer(group, dst, "destination")
    record = begin(group, "send", "native", describe(tensor), peer=dst, overlapped=True)
    work: Work | None
    if ordering.ordered(group):  # on the pair's stream, complete once received
        work = ordering.send(group, record, tensor.contiguous(), dst)
    else:
        work = dist.isend(tensor.contiguous(), dst=peer, group=group.pg)
    return Handle(group, record, [work], Traffic(_nbytes(tensor), 0, 1), tensor)


def irecv(tensor: torch.Tensor, group: CommGroup, src: int) -> Handle[torch.Tensor]:
    """Start receiving into `tensor` from group rank `src`; wait() returns the tensor."""
    peer = _check_peer(group, src, "source")
    record = begin(group, "recv", "native", describe(tensor), peer=src, overlapped=True)
    work: Work | None
    if ordering.ordered(group):  # on the pair's stream, blocking it until matched
        work = ordering.recv(group, record, tensor, src)
    else:
        work = dist.irecv(tensor, src=peer, group=group.pg)
    return Handle(group, record, [work], Traffic(0, _nbytes(tensor), 0), tensor)


def sendrecv(
    send: torch.Tensor, dst: int, into: torch.Tensor, src: int, group: CommGroup
) -> tuple[Handle[torch.Tensor], Handle[torch.Tensor]]:
    """Start sending `send` to group rank `dst` and receiving into `into` from `src` as one
    group call; (receive, send) handles (see `post`).

    NCCL runs unbatched point-to-point calls between two ranks in issue order on one
    stream, each blocking it until matched: two ranks that each post a receive from the
    other before their send (a ring of two, where left is right) wait for ever. One group
    call progresses both together, on any backend.
    """
    (received,), (sent,) = post(group, [(send, dst)], [(into, src)])
    return received, sent


def post(
    group: CommGroup,
    sends: list[tuple[torch.Tensor, int]],
    recvs: list[tuple[torch.Tensor, int]],
) -> tuple[list[Handle[torch.Tensor]], list[Handle[torch.Tensor]]]:
    """Start sends and receives (tensor, group rank) as one group call, torch's
    `batch_isend_irecv` (one NCCL group call, whose parts progress together); a handle per
    receive (wait() returns its tensor) and per send, each recorded in the ledger as an
    unbatched recv or send is."""
    for _, peer in sends + recvs:
        _check_peer(group, peer, "peer")
    sends = [(t.contiguous(), dst) for t, dst in sends]
    send_records = [
        begin(group, "send", "native", describe(t), peer=d, overlapped=True) for t, d in sends
    ]
    recv_records = [
        begin(group, "recv", "native", describe(t), peer=s, overlapped=True) for t, s in recvs
    ]
    works: Sequence[Work]
    if ordering.ordered(group):  # one call of the group's collective stream
        works = [ordering.batch(group, (send_records + recv_records)[0], sends, recvs)]
    else:
        works = _post(group, sends, recvs)  # receives first
    # gloo: a work per op, each to be waited for once (a second wait waits for a second
    # message). NCCL, or NCCL's order: one work for the call, which every handle waits for.
    each = len(works) == len(sends) + len(recvs)
    recv_works = [[w] for w in works[: len(recvs)]] if each else [works] * len(recvs)
    send_works = [[w] for w in works[len(recvs) :]] if each else [works] * len(sends)
    received = [
        Handle(group, r, w, Traffic(0, _nbytes(t), 0), t)
        for r, w, (t, _) in zip(recv_records, recv_works, recvs, strict=True)
    ]
    sent = [
        Handle(group, r, w, Traffic(_nbytes(t), 0, 1), t)
        for r, w, (t, _) in zip(send_records, send_works, sends, strict=True)
    ]
    return received, sent


def recv_any(tensor: torch.Tensor, group: CommGroup) -> int:
    """Receive into `tensor` from whichever group rank sends first; return that rank.

    What a parameter server needs: it serves workers in the order they push. NCCL has no
    receive from any source (ProcessGroupNCCL's recvAnysource throws): under its order
    this fails at once.
    """
    if ordering.ordered(group):
        raise ValueError(
            f"recv_any (receive from any source) on group {group.name!r} under comm order "
            "nccl: NCCL has none; receive from a named rank"
        )
    record = begin(group, "recv", "native", describe(tensor))
    work = dist.irecv(tensor, src=None, group=group.pg)
    assert work is not None  # None only on a rank outside the group
    handle = Handle(group, record, [work], Traffic(0, _nbytes(tensor), 0), tensor)
    handle.wait()
    return work.source_rank()  # the rank within the process group, which is ours


def send(tensor: torch.Tensor, group: CommGroup, dst: int) -> None:
    isend(tensor, group, dst).wait()


def recv(tensor: torch.Tensor, group: CommGroup, src: int) -> torch.Tensor:
    return irecv(tensor, group, src).wait()


def exchange(
    group: CommGroup,
    record: CallRecord,
    sends: list[tuple[torch.Tensor, int]],
    recvs: list[tuple[torch.Tensor, int]],
) -> Traffic:
    """Post all sends and receives of one algorithm step as one batch, then wait for them.

    Posting both sides before waiting is what keeps a ring from deadlocking: every rank
    sends right and receives left in the same step. Under NCCL a send blocks its stream
    until the peer's receive is posted, so the step's messages go in one
    `batch_isend_irecv` (one NCCL group call); gloo posts them one by one. Under NCCL's
    order the batch is a call of the group's collective stream (ordering.py): run in place
    on that stream's thread (our algorithms run there), else queued and waited for.
    """
    # Chunk sizes are known on both sides, so both skip the same empty messages.
    sends = [(t, dst) for t, dst in sends if t.numel() > 0]
    recvs = [(t, src) for t, src in recvs if t.numel() > 0]
    start = time.perf_counter()
    if not ordering.ordered(group):
        wait_works(group, record, _post(group, sends, recvs, algorithm_tag(group)))
    elif group.streams.collective.is_current():
        wait_works(group, record, ordering.post_batch(group, sends, recvs))
    else:
        wait_works(group, record, [ordering.batch(group, record, sends, recvs)])
    sent = sum(_nbytes(t) for t, _ in sends)
    o = group.options  # each step on our thread, on the simulated slower network
    hold_until(
        group,
        start + o.link_latency_s + (sent / o.link_bandwidth_Bps if o.link_bandwidth_Bps else 0),
    )
    return Traffic(sent, sum(_nbytes(t) for t, _ in recvs), len(sends))


def algorithm_tag(group: CommGroup) -> int:
    """The tag of our algorithms' messages in `group` (gloo's order). Gloo matches
    point-to-point messages by (peer, tag) alone, and groups as large as the world share
    its process group: at tag 0 a ring all-reduce of the dp_cp group, on its thread, took
    context parallelism's messages, sent meanwhile from backward on the same process
    group (`train --cp 2 --comm-algo ring` on 2 ranks: a size mismatch in gloo at step
    2). A tag per group name keeps each group's algorithms to their own messages."""
    return ALGORITHM_TAGS + zlib.crc32(group.name.encode()) % 2**16


def _post(
    group: CommGroup,
    sends: list[tuple[torch.Tensor, int]],
    recvs: list[tuple[torch.Tensor, int]],
    tag: int = 0,
) -> list[dist.Work]:
    pg = group.pg
    ops = [dist.P2POp(dist.irecv, t, group.to_global(src), pg, tag=tag) for t, src in recvs]
    ops += [
        dist.P2POp(dist.isend, t.contiguous(), group.to_global(dst), pg, tag=tag)
        for t, dst in sends
    ]
    return dist.batch_isend_irecv(ops) if ops else []


def add(a: Traffic, b: Traffic) -> Traffic:
    return Traffic(a.sent + b.sent, a.recv + b.recv, a.messages + b.messages)
