"""Everyone's counters in one report."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from paratrain.comm.call import begin, finish
from paratrain.comm.group import CommGroup
from paratrain.comm.traffic import Traffic
from paratrain.comm.wait import failure

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
    try:
        dist.all_gather_object(everyone, (group.global_rank, mine), group=group.pg)
    except RuntimeError as e:
        raise failure(group, record, e) from e
    finish(group, record, Traffic(0, 0, 0))
    return {"note": NOTE, "ranks": dict(everyone)}
