"""Per-rank record of communication, like PyTorch's flight recorder but for every backend.

Two views of the same calls:
- totals per (group, op): calls, bytes sent and received, messages, seconds waited. A rank
  reads and resets its own; `gather_report` collects everyone's into one report.
- the recent calls, each with a per-group sequence number, op, algorithm, shapes, dtype
  and state (started or done). The watchdog publishes them so that, when a collective
  times out, the ranks' records can be compared to name the first divergence.

Native collectives are counted with the bandwidth-optimal formulas of `traffic.py` (the
backend does not say what it sent); our ring and tree algorithms count what they sent.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from paratrain.comm.traffic import Traffic


@dataclass
class OpTotals:
    calls: int = 0
    bytes_sent: int = 0
    bytes_recv: int = 0
    messages: int = 0
    wait_s: float = 0.0


@dataclass
class CallRecord:
    """One call as the divergence report compares it across ranks."""

    seq: int  # per group: the n-th call this rank made on this group
    op: str
    group: str
    ranks: tuple[int, ...]
    algo: str
    shapes: str  # e.g. "float32[4, 8]" or "float32[4] -> [16]"
    start: float
    end: float | None = None  # None while the call is in flight
    bytes_sent: int = 0
    step: int = 0  # the training step the rank was in (0: outside the training loop)
    peer: int | None = None  # point-to-point: the other side's global rank

    @property
    def signature(self) -> str:
        return f"{self.op}({self.algo}) {self.shapes}"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Ledger:
    """Counters and recent calls of one rank. Thread-safe: the watchdog reads it."""

    max_recent: int = 64
    _totals: dict[tuple[str, str], OpTotals] = field(default_factory=dict)
    _recent: deque[CallRecord] = field(default_factory=deque)
    _seq: dict[tuple[str, tuple[int, ...]], int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    version: int = 0  # bumped on every change, so the watchdog publishes only news
    step: int = 0  # set by the training loop, recorded with every call

    def start(
        self,
        op: str,
        group: str,
        ranks: tuple[int, ...],
        algo: str,
        shapes: str,
        peer: int | None = None,
    ) -> CallRecord:
        with self._lock:
            key = (group, ranks)
            self._seq[key] = self._seq.get(key, 0) + 1
            record = CallRecord(self._seq[key], op, group, ranks, algo, shapes, time.perf_counter())
            record.step, record.peer = self.step, peer
            self._recent.append(record)
            while len(self._recent) > self.max_recent:
                self._recent.popleft()
            self.version += 1
            return record

    def finish(
        self, record: CallRecord, sent: int, recv: int, messages: int, waited: float
    ) -> None:
        """Count a completed call; `waited` is the time this rank was blocked on it."""
        with self._lock:
            record.end = time.perf_counter()
            record.bytes_sent = sent
            t = self._totals.setdefault((record.group, record.op), OpTotals())
            t.calls += 1
            t.bytes_sent += sent
            t.bytes_recv += recv
            t.messages += messages
            t.wait_s += waited
            self.version += 1

    def count(self, group: str, op: str, traffic: Traffic, waited: float = 0.0) -> None:
        """Count traffic that is not a call of its own (e.g. the per-call consistency check)."""
        with self._lock:
            t = self._totals.setdefault((group, op), OpTotals())
            t.calls += 1
            t.bytes_sent += traffic.sent
            t.bytes_recv += traffic.recv
            t.messages += traffic.messages
            t.wait_s += waited
            self.version += 1

    def reset(self) -> None:
        """Zero the counters. Sequence numbers keep counting: they identify calls."""
        with self._lock:
            self._totals.clear()
            self.version += 1

    def recent(self) -> list[CallRecord]:
        with self._lock:
            return list(self._recent)

    def totals(self) -> dict[tuple[str, str], OpTotals]:
        with self._lock:
            return {k: OpTotals(**asdict(v)) for k, v in self._totals.items()}

    def bytes_sent(self, group: str | None = None, op: str | None = None) -> int:
        return sum(
            t.bytes_sent
            for (g, o), t in self.totals().items()
            if (group is None or g == group) and (op is None or o == op)
        )

    def wait_s(self) -> float:
        return sum(t.wait_s for t in self.totals().values())

    def report(self) -> dict[str, dict[str, dict[str, float]]]:
        """{group: {op: {calls, bytes_sent, bytes_recv, messages, wait_s}}}, JSON-ready."""
        out: dict[str, dict[str, dict[str, float]]] = {}
        for (group, op), t in sorted(self.totals().items()):
            out.setdefault(group, {})[op] = asdict(t)
        return out
