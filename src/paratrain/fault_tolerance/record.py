"""RUN_DIR/quorum.jsonl: a line per round (participants, step, slices, committed or not),
and a `rewind` line where every group started again from a checkpoint (a resumed run, or
every group lost at once). What made the run's state are its effective rounds: the
committed ones, less those a later rewind went back before. The coordinator keeps the
record (`History`), a replay trains it again (`Script`), the summary counts it."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from paratrain.fault_tolerance.quorum import Decision, decide

QUORUM_FILE = "quorum.jsonl"
Line = dict[str, Any]


def read_lines(path: Path) -> list[Line]:
    return [json.loads(s) for s in path.read_text().splitlines() if s.strip()]


def effective_rounds(lines: list[Line]) -> list[Line]:
    """The committed rounds that made the state, in order: a rewind to step k discards
    the rounds of step k and later recorded before it (the checkpoint of step k was made
    after the rounds before k)."""
    kept: list[Line] = []
    for line in lines:
        if "rewind" in line:
            kept = [r for r in kept if r["step"] < line["rewind"]]
        elif line.get("committed"):
            kept.append(line)
    return kept


class History:
    """The coordinator's view of the record, from an earlier run's file if the run is
    resumed: where round and generation numbers go on, the step the effective rounds
    reached, and how many stream slices they trained (--ft-data replay goes on from it)."""

    def __init__(self, path: Path) -> None:
        lines = read_lines(path) if path.exists() else []
        self.next_round = max((line["round"] + 1 for line in lines), default=0)
        self.next_generation = max((line.get("generation", -1) + 1 for line in lines), default=0)
        self.effective = effective_rounds(lines)

    @property
    def next_step(self) -> int:
        return self.effective[-1]["step"] + 1 if self.effective else 0

    @property
    def trained(self) -> int:
        return sum(len(r["samples"]) for r in self.effective)

    def add(self, line: Line) -> None:
        if line["committed"]:
            self.effective.append(line)

    def rewind(self, step: int, round_: int) -> Line:
        """Every group starts again at `step`: the line that says so."""
        self.effective = [r for r in self.effective if r["step"] < step]
        return {"round": round_, "rewind": step}


class Script:
    """The effective rounds of a recorded run, in order: a replay's decisions."""

    def __init__(self, path: Path) -> None:
        self.rounds = effective_rounds(read_lines(path))
        self.ft_data = self.rounds[0]["ft_data"]  # the record's: it says what was dropped

    def decision(self, index: int, asks: dict[int, int]) -> Decision | None:
        """The index-th round once its participants have asked; None before."""
        want = self.rounds[index]
        mine = {g: s for g, s in asks.items() if g in want["participants"]}
        if len(mine) < len(want["participants"]):
            return None
        decision = decide(mine, 1)
        assert decision is not None
        if decision.step != want["step"]:
            raise RuntimeError(
                f"replay: round {want['round']} of the record computes step {want['step'] + 1}, "
                f"but its participants are at step {decision.step + 1}"
            )
        used = [want["samples"][str(g)] for g in decision.participants]
        return replace(decision, slots=tuple(lo // (hi - lo) for lo, hi in used))


def ft_data_of(replay_quorum: str, ft_data: str) -> str:
    """How the run's rounds assign samples: its --ft-data, or its record's in a replay."""
    return Script(Path(replay_quorum)).ft_data if replay_quorum else ft_data
