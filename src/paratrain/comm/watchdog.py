"""Hang diagnostics: each rank publishes its recent calls; a timed-out rank compares them.

A daemon thread per process writes the ledger's recent calls to the rendezvous store
whenever they change (every `interval_s` at most), so a rank's record stays readable even
when it is stuck outside communication or has died. When a call times out, the rank reads
every member's record and names the first divergence: the first call number on that group
where some member made no call, or where members called different ops or shapes.
"""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict
from typing import Any

import torch.distributed as dist

from paratrain.comm import compat
from paratrain.comm.ledger import Ledger

KEY = "paratrain/ledger/{rank}"


class Watchdog:
    def __init__(
        self, ledger: Ledger, store: dist.Store, global_rank: int, interval_s: float = 0.25
    ) -> None:
        self.ledger, self.store, self.global_rank = ledger, store, global_rank
        self.interval_s = interval_s
        self._published = -1
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="paratrain-watchdog", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self.ledger.version != self._published:
                try:
                    self.publish()
                except Exception:  # the store is gone (process group destroyed): stop quietly
                    return

    def publish(self) -> None:
        version = self.ledger.version
        payload = {
            "rank": self.global_rank,
            "published_at": time.time(),
            "perf_now": time.perf_counter(),
            "recent": [r.as_dict() for r in self.ledger.recent()],
        }
        self.store.set(KEY.format(rank=self.global_rank), json.dumps(payload))
        self._published = version

    def read(self, rank: int) -> dict[str, Any] | None:
        key = KEY.format(rank=rank)
        if not self.store.check([key]):
            return None
        ledger: dict[str, Any] = json.loads(self.store.get(key))
        return ledger

    def stop(self) -> None:
        self._stop.set()

    def divergence_report(self, group_name: str, ranks: list[int]) -> str:
        """Compare the published ledgers of the group's members (global `ranks`)."""
        self.publish()
        time.sleep(2 * self.interval_s)  # let peers that just started a call publish it
        ledgers = {}
        for rank in ranks:
            try:
                ledgers[rank] = self.read(rank)
            except Exception as e:  # a store that failed too: say so, don't mask the error
                ledgers[rank] = {"error": str(e)}
        return first_divergence(group_name, ranks, ledgers)


def _call_of(entry: dict[str, Any]) -> str:
    return f"{entry['op']}({entry['algo']}) {entry['shapes']}"


def _last_activity(ledger: dict[str, Any]) -> str:
    """What a rank was last seen doing, with ages as of now."""
    recent = ledger.get("recent") or []
    if not recent:
        return "no calls recorded"
    last = recent[-1]
    lag = time.time() - ledger["published_at"]
    where = f"call #{last['seq']} {_call_of(last)} on group {last['group']!r}"
    if last["end"] is None:
        return f"in flight: {where}, for {ledger['perf_now'] - last['start'] + lag:.1f} s"
    idle = ledger["perf_now"] - last["end"] + lag
    return f"not in any collective; last completed {where} {idle:.1f} s ago"


def first_divergence(
    group_name: str, ranks: list[int], ledgers: dict[int, dict[str, Any] | None]
) -> str:
    """Name the first call number on this group where the members' records disagree."""
    key = tuple(ranks)
    lines = []
    published = {r: ledger for r in ranks if (ledger := ledgers.get(r)) and "recent" in ledger}
    silent = [r for r in ranks if r not in published]
    if silent:
        lines.append(f"ranks {silent} published no ledger (died or never reached comm)")
    calls: dict[int, dict[int, dict[str, Any]]] = {}
    for r, ledger in published.items():  # in the order of ranks
        entries = ledger["recent"]
        calls[r] = {
            e["seq"]: e for e in entries if e["group"] == group_name and tuple(e["ranks"]) == key
        }
    if not calls:
        return "\n".join(lines or ["no ledgers to compare"])
    first = max((min(c) if c else 1) for c in calls.values())
    last = max((max(c) if c else 0) for c in calls.values())
    for seq in range(first, last + 1):
        present: dict[str, list[int]] = defaultdict(list)
        missing = []
        for r, c in calls.items():
            if seq in c:
                present[_call_of(c[seq])].append(r)
            else:
                missing.append(r)
        if missing or len(present) > 1:
            parts = [f"ranks {rs} called {call}" for call, rs in present.items()]
            parts += [
                f"rank {r} did not make this call ({_last_activity(published[r])})" for r in missing
            ]
            lines.insert(
                0,
                f"first divergence in group {group_name!r} {ranks} at call "
                f"#{seq}: " + "; ".join(parts),
            )
            return "\n".join(lines)
    activity = "; ".join(f"rank {r}: {_last_activity(published[r])}" for r in calls)
    lines.insert(
        0,
        f"no divergence in the recorded calls of group {group_name!r} up to "
        f"call #{last}: every rank made the same calls ({activity})",
    )
    return "\n".join(lines)


def default_store_or_none() -> dist.Store | None:
    """The rendezvous store of the default process group, where the watchdog publishes."""
    try:
        return compat.default_store()
    except (RuntimeError, AttributeError, ValueError):
        return None
