"""Waiting on the backend's work, always bounded, and the error that explains a call that
did not complete: this rank, the group, the op, its sequence number, then the watchdog's
comparison of every member's ledger (watchdog.py).

Gloo's `wait` blocks the host until the work is done or its timeout passes. NCCL's does
not: it only makes the current CUDA stream wait, and a hung peer would surface as NCCL's
own watchdog killing the process. On such groups the host therefore polls the work until
it completes, within the same timeout, so a hang gets the same report as on gloo, and
`settle` drains the device's queued compute at the points where the ledger starts its
clock, so that the seconds it records are seconds spent in communication (docs/comm.md).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Protocol

import torch

from paratrain.comm.group import CommGroup
from paratrain.comm.ledger import CallRecord


class Work(Protocol):
    """What a call is waited on through: the backend's `dist.Work`, or the `ThreadWork` and
    `StreamWork` of our own threads (progress.py, streams.py)."""

    def is_completed(self) -> bool: ...

    def wait(self, timeout: timedelta = ...) -> bool: ...


class CommError(RuntimeError):
    """A collective failed or timed out; the message names the rank, group, op and call."""


def timeout(group: CommGroup) -> timedelta:
    return timedelta(seconds=group.options.timeout_s)


POLL_S = 20e-6  # between polls of a device-side collective: short against any transfer


def settle(group: CommGroup) -> None:
    """On a group whose backend is asynchronous to the host (NCCL): wait until the compute
    already queued on this device's current stream has run, so that a clock started now
    measures the collective, not the work before it. A no-op elsewhere."""
    if group.asynchronous_to_host:
        torch.cuda.current_stream().synchronize()


def wait_works(group: CommGroup, record: CallRecord, works: Sequence[Work | None]) -> None:
    for work in works:
        if work is None:
            continue
        try:
            if group.asynchronous_to_host:
                _poll(work, group.options.timeout_s)
            work.wait(timeout=timeout(group))
        except CommError:
            raise  # from our communication thread: it already names the failed step
        except RuntimeError as e:
            raise failure(group, record, e) from e


def link_ready_at(group: CommGroup, start: float, steps: int, nbytes: int = 0) -> float:
    """When a native call of `steps` message steps sending `nbytes`, issued at `start`, may
    end on the simulated slower network (CommOptions.link_latency_s per step, and
    link_bandwidth_Bps): the link carries one call at a time, as one NCCL stream or one
    ring of our thread does, so it waits for the calls issued before it. Records the link
    busy until then."""
    o = group.options
    wire = nbytes / o.link_bandwidth_Bps if o.link_bandwidth_Bps else 0.0
    ready = max(start, group.link_free_at) + steps * o.link_latency_s + wire
    group.link_free_at = ready
    return ready


def hold_until(group: CommGroup, ready: float) -> None:
    if group.options.link_latency_s > 0 or group.options.link_bandwidth_Bps > 0:
        left = ready - time.perf_counter()
        if left > 0:  # a sleep of 0 still gives up the CPU: on a loaded machine, for ms
            time.sleep(left)


def _poll(work: Work, timeout_s: float) -> None:
    """Block the host until the device-side work completes, or raise after the timeout."""
    deadline = time.perf_counter() + timeout_s
    while not work.is_completed():
        if time.perf_counter() > deadline:
            raise RuntimeError(f"timed out after {timeout_s:g} s; the work is still pending")
        time.sleep(POLL_S)


def failure(group: CommGroup, record: CallRecord, err: BaseException) -> CommError:
    elapsed = time.perf_counter() - record.start
    cause = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    peer = "" if record.peer is None else f" with peer rank {record.peer}"
    step = f" in training step {record.step}" if record.step else ""
    head = (
        f"rank {group.global_rank} (rank {group.rank} of group {group.name!r}, ranks "
        f"{group.ranks}): {record.op}({record.algo}){peer} call #{record.seq} "
        f"{record.shapes}{step} failed after {elapsed:.1f} s: {cause}"
    )
    detail = getattr(err, "detail", "")  # under NCCL's order, the stream (ordering.py)
    if detail:
        head += "\n" + detail
    if group.watchdog is None:
        return CommError(head + "\n(no watchdog on this group: no comparison of ledgers)")
    return CommError(head + "\n" + group.watchdog.divergence_report(group.name, group.ranks))
