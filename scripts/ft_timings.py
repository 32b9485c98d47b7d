"""What per-step fault tolerance costs, and how fast it recovers: docs/benchmarks.md's figures.

    python scripts/ft_timings.py [--pairs 5] [--steps 30]

For 2 and 3 replica groups of one rank (ZeRO-1, a small GPT): `--pairs` alternating pairs
of runs, plain HSDP and `--fault-tolerance`, each reporting the median step time of its
steps after the first two (under fault tolerance a step's time includes its round: ask,
quorum, vote, commit). Then one run of 3 groups (400 steps) with a kill at step 10 and a
relaunch: the time from the failed round's start to the next commit, and to the
relaunched group's first round (its heal), from RUN_DIR/quorum.jsonl. Fails if a pair's
final losses differ by more than 1e-4 relative (the bound of tests/test_fault_tolerance.py).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SMALL = [
    "--n-layer", "2", "--d-model", "32", "--n-head", "2", "--seq-len", "32",
    "--micro-batch", "2", "--warmup-steps", "2", "--val-batches", "1", "--zero", "1",
]  # fmt: skip
# Without faults no group should be left out: a timeout no load reaches (a group late to
# ask would drop its samples and change the losses); the recovery run uses 1 s.
FT = ["--fault-tolerance", "--heartbeat-timeout-s", "60"]
RECOVERY = ["--fault-tolerance", "--heartbeat-timeout-s", "1"]


def train(out: Path, groups: int, steps: int, *extra: str) -> list[dict]:
    layout = ["--nproc", str(groups), "--replicas", str(groups), "--global-batch", str(4 * groups)]
    argv = [sys.executable, "-m", "paratrain", "train", *SMALL, *layout, "--steps", str(steps)]
    done = subprocess.run([*argv, "--out", str(out), *extra], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"paratrain train failed: {done.stderr.strip().splitlines()[-1]}")
    return [json.loads(s) for s in (out / "metrics.jsonl").read_text().splitlines()]


def median_step_s(rows: list[dict]) -> float:
    return statistics.median(r["step_s"] for r in rows[2:])


def cost(groups: int, pairs: int, steps: int, scratch: Path) -> None:
    sides: dict[str, list[float]] = {"hsdp": [], "ft": []}
    for i in range(pairs):
        order = ("hsdp", "ft") if i % 2 == 0 else ("ft", "hsdp")
        finals = {}
        for side in order:
            rows = train(
                scratch / f"{groups}-{i}-{side}", groups, steps, *(FT if side == "ft" else [])
            )
            sides[side].append(median_step_s(rows))
            finals[side] = rows[-1]["loss"]
        if abs(finals["ft"] - finals["hsdp"]) > 1e-4 * abs(finals["hsdp"]):
            raise SystemExit(f"pair {i}: final losses differ: {finals}")
    h, f = statistics.median(sides["hsdp"]), statistics.median(sides["ft"])
    spread = [round(1e3 * (a - b), 1) for a, b in zip(sides["ft"], sides["hsdp"], strict=True)]
    print(
        f"{groups} groups: step {1e3 * h:.1f} ms HSDP, {1e3 * f:.1f} ms fault tolerance "
        f"(medians of {pairs} runs); ratio {f / h:.2f}; per pair, ms more: {spread}"
    )


def recovery(steps: int, scratch: Path) -> None:
    out = scratch / "kill"
    train(out, 3, steps, *RECOVERY, "--min-replicas", "2", "--max-restarts", "1",
          "--inject-fault", "kill:1:10")  # fmt: skip
    rounds = [json.loads(s) for s in (out / "quorum.jsonl").read_text().splitlines()]
    failed = next(r for r in rounds if not r["committed"])
    after = rounds[rounds.index(failed) + 1 :]
    commit = next(r for r in after if r["committed"])
    healed = next((r for r in after if r["heal"]), None)
    rejoin = f"{healed['decided_s'] - failed['decided_s']:.1f} s" if healed else "not in time"
    to_commit = commit["ended_s"] - failed["decided_s"]
    print(
        f"3 groups, group 1 killed at step 10: next commit {to_commit:.2f} s after the failed "
        f"round began (heartbeat timeout 1 s); relaunched group back in {rejoin}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    print(
        f"{platform.processor() or platform.machine()}; python -m paratrain train {' '.join(SMALL)}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for groups in (2, 3):
            cost(groups, args.pairs, args.steps, Path(tmp))
        recovery(max(args.steps, 400), Path(tmp))  # long enough for the relaunch to rejoin


if __name__ == "__main__":
    main()
