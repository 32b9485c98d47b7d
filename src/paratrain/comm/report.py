"""Everyone's counters in one report."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from paratrain.comm import ordering
from paratrain.comm.call import begin, finish
from paratrain.comm.group import CommGroup
from paratrain.comm.traffic import Traffic
from paratrain.comm.wait import failure, wait_works

NOTE = (
    "bytes of native collectives are what the bandwidth-optimal (NCCL ring / chain) "
    "algorithm moves per rank, not measured; bytes of ring and tree algorithms and of "
    "send/recv are what was actually sent"
)


def gather_report(group: CommGroup) -> dict[str, Any]:
    """{"note": ..., "ranks": {global_rank: ledger report}} on every rank of the group.

    The report is taken before the exchange, so it does not count itself.
    """
    mine = group.ledger.report()
    if group.size == 1:
        return {"note": NOTE, "ranks": {group.global_rank: mine}}
    record = begin(group, "gather_report", "native", "-")
    everyone: list[Any] = [None] * group.size
    mine_tagged = (group.global_rank, mine)
    try:  # blocking: under NCCL's order, on the collective stream's thread (ordering.py)
        works = ordering.issue(
            group, record, lambda: dist.all_gather_object(everyone, mine_tagged, group=group.pg)
        )
    except RuntimeError as e:
        raise failure(group, record, e) from e
    wait_works(group, record, works)
    finish(group, record, Traffic(0, 0, 0))
    return {"note": NOTE, "ranks": dict(everyone)}
