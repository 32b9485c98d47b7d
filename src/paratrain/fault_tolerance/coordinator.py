"""The coordinator: a TCPStore every replica group reaches, and the thread that decides each
round from the groups' asks and heartbeats, collects their votes, commits or aborts, and
writes RUN_DIR/quorum.jsonl (the package's docstring has the protocol).

A group is alive while the counter its leader bumps (`hb/G`) keeps changing; before its
first beat it counts as alive for `STARTUP_GRACE_S`, so that the first round waits for
every group to start. A replay (`--replay-quorum`) has no heartbeats to trust and nothing
to decide: `Script` hands out the recorded rounds instead.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from paratrain.fault_tolerance.quorum import Decision, Quorum, assign_slots, decide, samples
from paratrain.fault_tolerance.record import History, Script

STARTUP_GRACE_S = 300.0  # a group not yet heard from is waited for this long
# The coordinator polls the store: every POLL_S one call asks whether every key it waits
# for is there (so a round waits little for it, and its thread costs the groups' cores
# little); every LOOK_S it also reads the heartbeats and the keys one by one (a failed
# vote, a silent group). Not `store.wait` with a short timeout: torch logs two warnings
# for every wait that times out.
POLL_S = 0.001
LOOK_S = 0.05
END = -1  # a quorum with this step and no participants: the run is over


@dataclass
class Beat:
    count: int = -1
    at: float = 0.0  # when the count last changed (the coordinator's clock)
    read_at: float = -1.0  # when the count was last read


class Coordinator:
    """Run by the launcher: `address` is what the groups connect to; `close` ends it."""

    def __init__(
        self,
        replicas: int,
        min_replicas: int,
        heartbeat_timeout_s: float,
        log_path: Path,
        global_batch: int,
        ft_data: str,
        script: Script | None = None,
        host: str = "127.0.0.1",
        port: int = 0,  # 0: a free port (`address` says which)
    ) -> None:
        self.replicas, self.min_replicas = replicas, min_replicas
        self.timeout_s, self.log_path = heartbeat_timeout_s, log_path
        self.global_batch, self.ft_data, self.script = global_batch, ft_data, script
        self.store = dist.TCPStore(
            host, port, is_master=True, wait_for_workers=False, timeout=timedelta(hours=1)
        )
        self.address = f"{host}:{self.store.port}"
        self.beats = [Beat() for _ in range(replicas)]
        self.started = time.monotonic()
        self.exited: set[int] = set()  # groups whose agent has exited: never coming back
        self.round = 0  # the round being decided
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self.done = threading.Event()  # the run is over and every group gone
        self._thread = threading.Thread(target=self._run, name="ft-coordinator", daemon=True)
        self._thread.start()

    def agent_exited(self, group: int) -> None:
        self.exited.add(group)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        if self.error is not None:
            raise self.error

    # -- liveness ----------------------------------------------------------------------
    def _alive(self, group: int, now: float) -> bool:
        if group in self.exited or self.store.check([f"left/{group}"]):
            return False
        beat = self.beats[group]
        if now - beat.read_at >= LOOK_S:  # a beat is timed to this, not to each poll
            count, beat.read_at = self.store.add(f"hb/{group}", 0), now
            if count != beat.count:
                beat.count, beat.at = count, now
        if beat.count == 0:  # never heard from
            return now - self.started < STARTUP_GRACE_S
        return now - beat.at < self.timeout_s

    # -- rounds ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._rounds()
            self._goodbyes()
            self.done.set()
        except BaseException as e:  # reported by close(), in the launcher's thread
            self.error = e
            self.store.set("quorum/error", str(e))
            for key in (f"quorum/{self.round}", f"commit/{self.round}"):  # wake its waiters
                if not self.store.check([key]):
                    self.store.set(key, "error")

    def _rounds(self) -> None:
        history = History(self.log_path)  # a resumed run's rounds go on from its record
        r, generation, previous = history.next_round, history.next_generation, None
        with self.log_path.open("a") as log:
            while not self._stop.is_set():
                self.round = r
                self.store.set("round", str(r))
                decision, incarnations = self._wait_for_quorum(r, history.next_step)
                if decision is None:  # stopped, or nobody left to train
                    self.store.set(f"quorum/{r}", Quorum(r, END, generation, ()).to_json())
                    return
                if decision.step < history.next_step and self.script is None:
                    log.write(json.dumps(history.rewind(decision.step, r)) + "\n")
                if previous is not None and decision.participants != previous:
                    generation += 1
                step, participants = decision.step, decision.participants
                slots = decision.slots or assign_slots(
                    step, participants, self.replicas, self.ft_data, history.trained
                )
                asked_by = tuple(incarnations[g] for g in participants)
                quorum = Quorum(r, step, generation, participants, decision.heal, slots, asked_by)
                self.store.set(f"quorum/{r}", quorum.to_json())
                decided = time.monotonic() - self.started
                committed = self._wait_for_votes(quorum)
                self.store.set(f"commit/{r}", "1" if committed else "0")
                ended = time.monotonic() - self.started
                record = self._record(quorum, committed) | {"decided_s": decided, "ended_s": ended}
                log.write(json.dumps(record) + "\n")
                log.flush()
                history.add(record)
                previous = decision.participants
                if not committed:
                    generation += 1  # a failed gloo group is not reused
                r += 1

    def _asks(self, r: int, now: float) -> tuple[dict[int, int], dict[int, int]]:
        """The live groups' asks for round `r`: the step each is at, and the incarnation
        of the group that asked."""
        asks, incarnations = {}, {}
        for g in range(self.replicas):
            key = f"ask/{r}/{g}"
            if self.store.check([key]) and (self.script is not None or self._alive(g, now)):
                step, incarnation = self.store.get(key).split()
                asks[g], incarnations[g] = int(step), int(incarnation)
        return asks, incarnations

    def _wait_for_quorum(self, r: int, next_step: int) -> tuple[Decision | None, dict[int, int]]:
        """Every live group has asked (or one heartbeat timeout has passed since the first
        ask), and enough did; None when no group can ever ask again. A round that goes
        back before `next_step` (every group from a checkpoint) waits for every live group:
        one left out as late could hold the later state. With the decision, the
        incarnations that asked."""
        first_ask, now = None, time.monotonic()
        while not self._stop.is_set():
            asks, incarnations = self._asks(r, now)
            if self.script is not None:
                if r >= len(self.script.rounds):
                    return None, {}
                decision = self.script.decision(r, asks)
                if decision is not None:
                    return decision, incarnations
            else:
                waiting = [g for g in range(self.replicas) if self._alive(g, now) and g not in asks]
                if asks and first_ask is None:
                    first_ask = now
                late = first_ask is not None and now - first_ask > self.timeout_s
                if not waiting or late:
                    decision = decide(asks, self.min_replicas)
                    if decision is not None and (not waiting or decision.step >= next_step):
                        return decision, incarnations
                if not waiting and self._nobody_else_can_come(asks):
                    return None, {}  # e.g. relaunched after the others finished: nothing to join
            alive = [g for g in range(self.replicas) if g in asks or self._alive(g, now)]
            now = self._next_look([f"ask/{r}/{g}" for g in alive], now)
        return None, {}

    def _next_look(self, keys: list[str], last: float) -> float:
        """When to look again: once every key is there, or LOOK_S after the last look."""
        time.sleep(POLL_S)
        while not self._stop.is_set():
            now = time.monotonic()
            if now - last >= LOOK_S or self.store.check(keys):
                return now
            time.sleep(POLL_S)
        return time.monotonic()

    def _nobody_else_can_come(self, asks: dict[int, int]) -> bool:
        """Every group that has not asked is gone for good, and those that asked cannot
        form a round by themselves."""
        if decide(asks, self.min_replicas) is not None:
            return False
        now = time.monotonic()
        return all(g in asks or self._gone(g, now) for g in range(self.replicas))

    def _gone(self, group: int, now: float) -> bool:
        """Gone for good: finished (it left), its agent has exited, or (started by torchrun
        elsewhere, whose restarts this process does not see) silent for STARTUP_GRACE_S."""
        if group in self.exited or self.store.check([f"left/{group}"]):
            return True
        self._alive(group, now)  # reads the heartbeat
        beat = self.beats[group]
        since = beat.at if beat.count > 0 else self.started
        return now - since > STARTUP_GRACE_S

    def _goodbyes(self) -> None:
        """After the last round: until every group is gone (its summary written)."""
        while not self._stop.is_set():
            now = time.monotonic()
            if all(self._gone(g, now) for g in range(self.replicas)):
                return
            time.sleep(LOOK_S)

    def _wait_for_votes(self, quorum: Quorum) -> bool:
        """True when every participant voted that its round succeeded; False at the first
        failed vote or when a participant that has not voted goes silent, or is relaunched
        (its heart beats again before it was seen silent: the incarnation that asked is
        gone)."""
        keys = [f"vote/{quorum.round}/{g}" for g in quorum.participants]
        now = time.monotonic()
        while True:
            votes = {}
            for g, key in zip(quorum.participants, keys, strict=True):
                if self.store.check([key]):
                    votes[g] = self.store.get(key) == b"1"
            if not all(votes.values()):
                return False
            if len(votes) == len(quorum.participants):
                return True
            silent = [
                g
                for g, incarnation in zip(quorum.participants, quorum.incarnations, strict=True)
                if g not in votes
                and (not self._alive(g, now) or self._incarnation(g) != incarnation)
            ]
            if (silent and self.script is None) or self._stop.is_set():
                return False
            now = self._next_look(keys, now)

    def _incarnation(self, group: int) -> int:
        return self.store.add(f"inc/{group}", 0)

    def _record(self, quorum: Quorum, committed: bool) -> dict[str, object]:
        used = {
            str(g): list(samples(slot, self.global_batch, self.replicas))
            for g, slot in zip(quorum.participants, quorum.slots, strict=True)
        }
        return {
            "round": quorum.round,
            "step": quorum.step,
            "participants": list(quorum.participants),
            "generation": quorum.generation,
            "heal": [list(pair) for pair in quorum.heal],
            "committed": committed,
            "samples": used,
            "ft_data": self.ft_data,
        }
