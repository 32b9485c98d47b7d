"""Optional per-call check that every rank issues the same op with the same shapes.

Like TORCH_DISTRIBUTED_DEBUG=DETAIL, for every backend: before the call, the ranks
all-gather (sequence number, op, algorithm, shapes) as fixed-size bytes and compare. A
mismatch fails at once on every rank with a message naming who called what, instead of a
hang or a silently wrong result. It costs one small all-gather per call.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from paratrain.comm import compat, ordering
from paratrain.comm.group import CommGroup
from paratrain.comm.ledger import CallRecord
from paratrain.comm.traffic import native_traffic
from paratrain.comm.wait import CommError, wait_works

WIDTH = 160  # bytes per rank for "#seq signature"


def _encode(text: str, device: torch.device) -> torch.Tensor:
    raw = text.encode()[:WIDTH].ljust(WIDTH, b"\0")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)


def verify_same_call(group: CommGroup, record: CallRecord) -> None:
    mine = f"#{record.seq} {record.signature}"
    everyone = torch.empty(WIDTH * group.size, dtype=torch.uint8, device=group.device)
    encoded = _encode(mine, group.device)
    start = lambda: compat.all_gather_single(everyone, encoded, group=group.pg, async_op=True)  # noqa: E731
    wait_works(group, record, ordering.issue(group, record, start))
    traffic = native_traffic("all_gather", WIDTH * group.size, group.size, group.rank)
    group.ledger.count(group.name, "check", traffic)
    calls = [
        bytes(c.tolist()).rstrip(b"\0").decode(errors="replace") for c in everyone.split(WIDTH)
    ]
    if len(set(calls)) > 1:
        by_call: dict[str, list[int]] = defaultdict(list)
        for rank, call in zip(group.ranks, calls, strict=True):
            by_call[call].append(rank)
        seen = "; ".join(f"ranks {ranks}: {call}" for call, ranks in by_call.items())
        raise CommError(
            f"rank {group.global_rank}: ranks of group {group.name!r} disagree on the next "
            f"call: {seen}"
        )
