"""Per-rank record of communication: bytes, messages and waiting time per op and group.

For native collectives the bytes recorded are what a bandwidth-optimal algorithm must move
per rank (the backend does not report what it sent); for our own point-to-point algorithms
they are what was actually sent. `native_traffic` states the formulas.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass


@dataclass
class OpTotals:
    calls: int = 0
    bytes_sent: int = 0
    bytes_recv: int = 0
    messages: int = 0
    wait_s: float = 0.0


@dataclass(frozen=True)
class CommEvent:
    seq: int
    op: str
    group: str
    bytes_sent: int
    start: float
    end: float


def native_traffic(op: str, nbytes: int, size: int, is_root: bool = False) -> tuple[int, int]:
    """(sent, received) bytes per rank for a bandwidth-optimal native collective.

    all_reduce: reduce-scatter then all-gather, each moving (k-1)/k of the tensor:
        sent = received = 2 (k-1) S / k.
    broadcast: the k-1 non-root ranks must each receive S; spreading the (k-1) S of
        sends evenly (scatter + all-gather, or a pipelined chain) gives (k-1) S / k each.
    """
    if size == 1:
        return 0, 0
    if op == "all_reduce":
        moved = 2 * (size - 1) * nbytes // size
        return moved, moved
    if op == "broadcast":
        return (size - 1) * nbytes // size, 0 if is_root else nbytes
    raise ValueError(f"no traffic formula for op {op!r}")


class Ledger:
    """Counters of one rank. Keeps totals per (group, op) and the last `max_events` calls."""

    def __init__(self, max_events: int = 10_000) -> None:
        self.max_events = max_events
        self.reset()

    def reset(self) -> None:
        self._totals: dict[tuple[str, str], OpTotals] = {}
        self.events: list[CommEvent] = []
        self._seq = 0

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def record(
        self,
        op: str,
        group: str,
        sent: int,
        recv: int,
        messages: int,
        start: float,
        end: float | None = None,
        seq: int | None = None,
    ) -> None:
        end = time.perf_counter() if end is None else end
        t = self._totals.setdefault((group, op), OpTotals())
        t.calls += 1
        t.bytes_sent += sent
        t.bytes_recv += recv
        t.messages += messages
        t.wait_s += end - start
        if len(self.events) < self.max_events:
            self.events.append(CommEvent(seq or self.next_seq(), op, group, sent, start, end))

    def totals(self) -> dict[tuple[str, str], OpTotals]:
        return dict(self._totals)

    def bytes_sent(self, group: str | None = None, op: str | None = None) -> int:
        return sum(
            t.bytes_sent
            for (g, o), t in self._totals.items()
            if (group is None or g == group) and (op is None or o == op)
        )

    def wait_s(self) -> float:
        return sum(t.wait_s for t in self._totals.values())

    def report(self) -> dict[str, dict[str, dict[str, float]]]:
        """{group: {op: {calls, bytes_sent, bytes_recv, messages, wait_s}}}, JSON-ready."""
        out: dict[str, dict[str, dict[str, float]]] = {}
        for (group, op), t in sorted(self._totals.items()):
            out.setdefault(group, {})[op] = asdict(t)
        return out
