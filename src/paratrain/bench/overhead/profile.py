"""`paratrain bench overhead --profile N`: where our step and the plain loop differ, op by
op. torch.profiler records N steps of each loop; the ops whose calls or self CPU time
differ most are listed per step, so a difference in the timed ratio can be traced to the
ops that make it (an extra pass over the gradients shows as 69 more multiplies a step for
the default GPT)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from torch.profiler import ProfilerActivity, profile

log = logging.getLogger(__name__)
Step = Callable[[int], float]  # step index -> loss
ROWS = 12


def _per_op(fn: Step, steps: range) -> dict[str, tuple[int, float]]:
    """op -> (calls, self CPU microseconds) over the steps."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for step in steps:
            fn(step)
    return {e.key: (e.count, e.self_cpu_time_total) for e in prof.key_averages()}


def op_differences(ours: Step, plain: Step, steps: range) -> list[dict[str, float | str]]:
    """Per step: each op's calls and self CPU milliseconds on both sides, the largest
    differences of time first (the sides run `steps` in turn, ours first)."""
    mine, theirs = _per_op(ours, steps), _per_op(plain, steps)
    n = len(steps)
    rows: list[dict[str, float | str]] = []
    for op in mine.keys() | theirs.keys():
        (a_calls, a_us), (b_calls, b_us) = mine.get(op, (0, 0.0)), theirs.get(op, (0, 0.0))
        rows.append({"op": op, "ours_calls": a_calls / n, "plain_calls": b_calls / n,
                     "ours_ms": a_us / n / 1e3, "plain_ms": b_us / n / 1e3})  # fmt: skip
    rows.sort(key=lambda r: -abs(float(r["ours_ms"]) - float(r["plain_ms"])))
    return rows


def log_differences(rows: list[dict[str, float | str]], steps: int) -> None:
    ours = sum(float(r["ours_ms"]) for r in rows)
    plain = sum(float(r["plain_ms"]) for r in rows)
    log.info(
        "profile, %d steps each; per step: self CPU ms ours %.2f, plain %.2f", steps, ours, plain
    )
    log.info("%-44s %10s %10s %9s %9s", "op", "ours calls", "plain", "ours ms", "plain ms")
    for r in rows[:ROWS]:
        log.info(
            "%-44s %10.1f %10.1f %9.3f %9.3f",
            str(r["op"])[:44], r["ours_calls"], r["plain_calls"], r["ours_ms"], r["plain_ms"],
        )  # fmt: skip
