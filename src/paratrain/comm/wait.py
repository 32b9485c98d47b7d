"""Waiting on the backend's work, always bounded, and the error that explains a call that
did not complete: this rank, the group, the op, its sequence number, then the watchdog's
comparison of every member's ledger (watchdog.py)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as dist

from paratrain.comm.group import CommGroup
from paratrain.comm.ledger import CallRecord


class CommError(RuntimeError):
    """A collective failed or timed out; the message names the rank, group, op and call."""


def timeout(group: CommGroup) -> timedelta:
    return timedelta(seconds=group.options.timeout_s)


def wait_works(group: CommGroup, record: CallRecord, works: Sequence[dist.Work | None]) -> None:
    for work in works:
        if work is None:
            continue
        try:
            work.wait(timeout=timeout(group))
        except RuntimeError as e:
            raise failure(group, record, e) from e


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
    if group.watchdog is None:
        return CommError(head + "\n(no watchdog on this group: no comparison of ledgers)")
    return CommError(head + "\n" + group.watchdog.divergence_report(group.name, group.ranks))
