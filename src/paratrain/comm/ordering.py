"""NCCL's stream order enforced on gloo (`CommOptions(order="nccl")`, `--comm-order nccl`).

Gloo forgives what NCCL does not: it buffers a send until the peer asks for it and
progresses every point-to-point call on its own. ProcessGroupNCCL instead queues each call
on a CUDA stream, where it runs after the calls before it and blocks the calls after it
until it completes (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp, `pointToPoint` and
`collective`; docs/comm.md, "NCCL's ordering on gloo"):
- a group's collectives share the stream of its device communicator (key: the device);
- an unbatched send or recv uses the communicator of its pair, key "low:high", and that
  pair's stream: one per peer, in issue order;
- a batch (`batch_isend_irecv`, our `exchange`) is one NCCL group call whose parts
  progress together; it runs on the device communicator, so on the collectives' stream;
- a send completes only once the peer's matching receive runs, and the reverse.

Here each stream is a queue served by one thread that issues the gloo call and waits for
it before taking the next, so a call reaches gloo only when it would run on NCCL's
stream. Matching then needs nothing more: gloo's TCP transport holds a send until the
receiver has posted the matching receive (a rendezvous, not a buffer: a blocking send
ahead of the peer's receive hangs on plain gloo too, tests/test_comm_order.py checks it),
and a receive completes only when the data arrives. So a send completes once its receive
runs on the peer's stream, as on NCCL, at no extra message. Batched messages travel under
their own tag, so they match only batched messages, as on NCCL's separate
communicators. A caller that waits on a call blocked in its stream gets `StreamBlocked`
after the group's timeout, naming the stream and the calls queued on it ahead of the one
waited for (wait.py adds it to the hang report).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from paratrain.comm.streams import StreamWork

if TYPE_CHECKING:
    from paratrain.comm.group import CommGroup
    from paratrain.comm.ledger import CallRecord

BATCH_TAG = 0x5EB  # batched messages: never match an unbatched send or recv (tag 0)
# The stream's thread waits on gloo longer than the caller does, so that the caller's
# timeout fires first and reports the stream as it stands.
WORKER_WAIT_FACTOR = 2.0


def ordered(group: CommGroup) -> bool:
    """Whether the group runs under NCCL's order (its options say so)."""
    return group.options.order == "nccl"


def label(record: CallRecord, direction: str = "") -> str:
    """'send #4 float32[4] to rank 0': how a call is named on its stream."""
    algo = "" if record.algo == "native" else f"({record.algo})"
    return f"{record.op}{algo} #{record.seq} {record.shapes}{direction}"


def _complete(group: CommGroup, works: Sequence[Any]) -> None:
    """On a stream's thread: wait for gloo's works (RuntimeError after the bound)."""
    bound = timedelta(seconds=group.options.timeout_s * WORKER_WAIT_FACTOR)
    for work in works:
        if work is not None:
            work.wait(timeout=bound)


def issue(group: CommGroup, record: CallRecord, call: Callable[[], Any]) -> list[Any]:
    """Start a native collective: now (gloo's order), or as the next call on the group's
    collective stream, which issues it and waits for it (NCCL's). `call` returns a work,
    or None when it blocked until done (object collectives)."""
    if not ordered(group):
        work = call()
        return [None if work is None else KeptWork(work, call)]
    run = lambda: _complete(group, [call()])  # noqa: E731
    return [group.streams.collective.submit(label(record), run, "waiting for the group")]


class KeptWork:
    """A backend's work holding the call that started it, and so the tensors the call was
    given, until the work is dropped. Gloo's and NCCL's works keep their tensors so;
    torch's fake backend keeps none, and a simulated rank would free a collective's
    scratch (comm/padded.py's pieces) while it is in flight (simulate/)."""

    def __init__(self, work: Any, call: Callable[[], Any]) -> None:
        self.work, self._call = work, call

    def is_completed(self) -> bool:
        return bool(self.work.is_completed())

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:  # 0: the backend's default
        return bool(self.work.wait(timeout=timeout))


def run_ours(group: CommGroup, record: CallRecord, call: Callable[[], Any]) -> StreamWork:
    """One of our algorithms as one call of the collective stream (returns its traffic)."""
    return group.streams.collective.submit(label(record), call, "waiting for the group")


def send(group: CommGroup, record: CallRecord, tensor: torch.Tensor, dst: int) -> StreamWork:
    """An unbatched send on its pair's stream, complete once group rank `dst` has posted
    the receive (gloo's rendezvous), that is, once that receive runs on its stream."""
    peer = group.to_global(dst)
    start = lambda: dist.isend(tensor, dst=peer, group=group.pg)  # noqa: E731
    return _on_pair(group, record, dst, start, f" to rank {peer}", "receive from")


def recv(group: CommGroup, record: CallRecord, tensor: torch.Tensor, src: int) -> StreamWork:
    """An unbatched receive on its pair's stream, blocking it until the data arrives."""
    peer = group.to_global(src)
    start = lambda: dist.irecv(tensor, src=peer, group=group.pg)  # noqa: E731
    return _on_pair(group, record, src, start, f" from rank {peer}", "send from")


def _on_pair(
    group: CommGroup, record: CallRecord, peer: int, start: Callable[[], Any], where: str,
    missing: str,
) -> StreamWork:  # fmt: skip
    """The call `start` issues, as the next on the stream of the pair with group rank
    `peer`, which it blocks until it is matched."""
    blocked = f"no matching {missing} rank {group.to_global(peer)} yet"
    run = lambda: _complete(group, [start()])  # noqa: E731
    return group.streams.pair(peer).submit(label(record, where), run, blocked)


def post_batch(
    group: CommGroup,
    sends: list[tuple[torch.Tensor, int]],
    recvs: list[tuple[torch.Tensor, int]],
) -> list[Any]:
    """Post one batch (peers are group ranks), all parts together as in one NCCL group
    call; return its works."""
    pg = group.pg
    ops = [dist.P2POp(dist.irecv, t, group.to_global(s), pg, tag=BATCH_TAG) for t, s in recvs]
    ops += [
        dist.P2POp(dist.isend, t.contiguous(), group.to_global(d), pg, tag=BATCH_TAG)
        for t, d in sends
    ]
    return dist.batch_isend_irecv(ops) if ops else []


def batch(
    group: CommGroup,
    record: CallRecord,
    sends: list[tuple[torch.Tensor, int]],
    recvs: list[tuple[torch.Tensor, int]],
) -> StreamWork:
    """A batch as the next call of the collective stream (from any thread but its own)."""

    def run() -> None:
        _complete(group, post_batch(group, sends, recvs))

    peers = sorted({group.to_global(p) for _, p in sends + recvs})
    blocked = f"its parts not all matched by ranks {peers}"
    return group.streams.collective.submit(label(record), run, blocked)
