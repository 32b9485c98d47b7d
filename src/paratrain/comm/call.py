"""The life of one communication call: record it, wait with a timeout, count it, or explain.

Every op in this package goes through `begin` and then either `finish` (blocking calls) or
a `Handle` (asynchronous ones). Waiting is bounded by the group's timeout (wait.py); a call
that does not complete raises CommError naming this rank, the group, the op and its
sequence number, followed by the watchdog's comparison of all ranks' ledgers. Our own
algorithms run on the group's communication thread (`run_ours`, progress.py), so that
they stay in flight behind a Handle as native collectives do.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Generic, Literal, TypeAlias, TypeVar, overload

import torch

from paratrain.comm import ordering
from paratrain.comm.group import CommGroup
from paratrain.comm.ledger import CallRecord
from paratrain.comm.progress import ThreadWork
from paratrain.comm.same_call import verify_same_call
from paratrain.comm.streams import StreamWork
from paratrain.comm.traffic import Traffic
from paratrain.comm.wait import Work, hold_until, link_ready_at, settle, wait_works

T = TypeVar("T")  # what a call gives back once done: its tensor, mostly; None for ours


def describe(*tensors: torch.Tensor | None) -> str:
    """'float32[4, 8]' for one tensor, 'float32[4] -> [16]' for an input and an output."""
    shown = [t for t in tensors if t is not None]
    if not shown:
        return "-"
    first = f"{str(shown[0].dtype).removeprefix('torch.')}{list(shown[0].shape)}"
    return " -> ".join([first] + [str(list(t.shape)) for t in shown[1:]])


def begin(
    group: CommGroup,
    op: str,
    algo: str,
    shapes: str,
    peer: int | None = None,
    overlapped: bool = False,
) -> CallRecord:
    """Record the start of a call; `peer` (a rank of the group) for point-to-point ones.

    overlapped: the call is left in flight behind a Handle, whose `wait` starts the clock
    that counts; issuing it must not stall the host (it runs inside backward's hooks).
    """
    if not overlapped:
        settle(group)  # NCCL: the clock starts when the device has caught up with the host
    peer_global = None if peer is None else group.ranks[peer]
    record = group.ledger.start(op, group.name, tuple(group.ranks), algo, shapes, peer_global)
    if group.options.check and group.size > 1:
        verify_same_call(group, record)
    return record


def finish(group: CommGroup, record: CallRecord, traffic: Traffic) -> None:
    if record.algo == "native":  # ours hold each step where it is sent (p2p.exchange)
        hold_until(group, link_ready_at(group, record.start, traffic.messages, traffic.sent))
    group.ledger.finish(
        record, traffic.sent, traffic.recv, traffic.messages, time.perf_counter() - record.start
    )


class Handle(Generic[T]):
    """A call in flight. `wait()` blocks (bounded by the timeout), counts it, returns its result.

    `traffic` None: the call is one of ours on the communication thread, whose single work
    says what was sent once it is done.
    """

    def __init__(
        self,
        group: CommGroup,
        record: CallRecord,
        works: Sequence[Work | None],
        traffic: Traffic | None,
        result: T | None = None,
        then: Callable[[], T] | None = None,
        blocked_from: float | None = None,
    ) -> None:
        self.group, self.record, self.works, self.traffic = group, record, list(works), traffic
        self._result, self._then, self._done = result, then, False
        self._blocked_from = blocked_from  # a call its caller waited for from the start
        self._ready = 0.0  # when the simulated link lets a native call end (wait.py)
        if traffic is not None and record.algo == "native":
            self._ready = link_ready_at(group, record.start, traffic.messages, traffic.sent)

    @property
    def seq(self) -> int:
        """The ledger's sequence number of this call."""
        return self.record.seq

    def is_completed(self) -> bool:
        return self._done or all(w is None or w.is_completed() for w in self.works)

    def wait(self) -> T:
        if not self._done:
            settle(self.group)  # NCCL: count only the waiting that compute did not hide
            issued = self._blocked_from or time.perf_counter()
            wait_works(self.group, self.record, self.works)
            traffic = self.traffic or _sent_by_ours(self.works[0])
            hold_until(self.group, self._ready)
            if self._then is not None:
                self._result = self._then()
            waited = time.perf_counter() - issued
            self.group.ledger.finish(
                self.record, traffic.sent, traffic.recv, traffic.messages, waited
            )
            self._done = True
        # None only where T is None: a call of ours given neither a result nor `then`.
        return self._result  # type: ignore[return-value]


def _sent_by_ours(work: Work | None) -> Traffic:
    """What one of our algorithms sent, recorded by the thread that ran it."""
    assert isinstance(work, ThreadWork | StreamWork) and work.traffic is not None, work
    return work.traffic


class Done(Generic[T]):
    """The handle of a call that already finished (and was counted, if it communicated)."""

    seq = None  # not a call in flight: nothing in the ledger to point at

    def __init__(self, result: T) -> None:
        self._result = result

    def is_completed(self) -> bool:
        return True

    def wait(self) -> T:
        return self._result


# What an op called with async_op=True returns: its tensor still to come.
Pending: TypeAlias = "Handle[torch.Tensor] | Done[torch.Tensor]"


@overload
def issued(handle: Handle[T], async_op: Literal[True]) -> Handle[T] | Done[T]: ...
@overload
def issued(handle: Handle[T], async_op: bool) -> T | Handle[T] | Done[T]: ...
def issued(handle: Handle[T], async_op: bool) -> T | Handle[T] | Done[T]:
    """What an op returns: its handle, in flight; or its result once done, when the caller
    did not ask for async or the group's options switch overlap off."""
    if async_op and handle.group.options.overlap:
        return handle
    result = handle.wait()
    return Done(result) if async_op else result


@overload
def run_ours(
    group: CommGroup,
    record: CallRecord,
    call: Callable[[], Traffic],
    async_op: Literal[True],
    then: Callable[[], T] | None = ...,
) -> Handle[T] | Done[T]: ...
@overload
def run_ours(
    group: CommGroup,
    record: CallRecord,
    call: Callable[[], Traffic],
    async_op: bool,
    then: Callable[[], T] | None = ...,
) -> T | Handle[T] | Done[T]: ...
def run_ours(
    group: CommGroup,
    record: CallRecord,
    call: Callable[[], Traffic],
    async_op: bool,
    then: Callable[[], T] | None = None,
) -> T | Handle[T] | Done[T]:
    """Run one of our algorithms (`call` returns what it sent) on the group's thread; one
    waited for at once runs in the caller's thread if nothing is queued (progress.py).
    Under NCCL's order, as one call of the group's collective stream (ordering.py)."""
    stream = ordering.ordered(group)
    if async_op and group.options.overlap:
        work = ordering.run_ours(group, record, call) if stream else group.progress.submit(call)
        return Handle(group, record, [work], None, then=then)
    blocked_from = time.perf_counter()  # the caller waits from here, whoever runs it
    work = ordering.run_ours(group, record, call) if stream else group.progress.run_here(call)
    handle = Handle(group, record, [work], None, then=then, blocked_from=blocked_from)
    return issued(handle, async_op)
