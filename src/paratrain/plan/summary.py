"""The head of a plan for a reader: which layouts to show in what order, the fastest layout
that fits, and what the recommendation trades against it.

The recommendation follows the seeds' rule (recommend.py: the least parallelism that fits,
simplest to run); it is often not the fastest. When they differ, `trade` says by how much
and what the faster one costs, so a reader sees both before choosing.
"""

from __future__ import annotations

from collections.abc import Callable

from paratrain.plan.cluster import GB
from paratrain.plan.estimate import Estimate
from paratrain.plan.recommend import TIERS, Plan, tier

SORTS = ("time", "memory", "mfu")
DEFAULT_ROWS = 15  # the default view: the best layouts by --sort, the recommendation first


def _step(e: Estimate) -> float:
    return e.time.total_s if e.time is not None else float("inf")


SORT_KEYS: dict[str, Callable[[Estimate], float]] = {
    "time": _step,
    "memory": lambda e: e.memory_bytes,
    "mfu": lambda e: -(e.mfu or 0.0),  # highest first
}


def fastest_fitting(plan: Plan) -> Estimate | None:
    """The fitting layout with the shortest step."""
    timed = [e for e in plan.estimates if e.fits and e.time is not None]
    return min(timed, key=_step, default=None)


def shown_rows(plan: Plan, sort: str = "time", show_all: bool = False) -> list[Estimate]:
    """Fitting layouts by `sort`, the recommendation first; DEFAULT_ROWS unless show_all."""
    if sort not in SORT_KEYS:
        raise ValueError(f"--sort {sort!r}; valid: {', '.join(SORTS)}")
    fitting = sorted((e for e in plan.estimates if e.fits), key=SORT_KEYS[sort])
    best = plan.recommended
    rows = ([best] if best is not None else []) + [e for e in fitting if e is not best]
    return rows if show_all else rows[:DEFAULT_ROWS]


def _axes(e: Estimate) -> str:
    """The parallelism a layout adds beyond data parallel, in words."""
    lay, parts = e.layout, []
    for axis, name in (("tp", "tensor"), ("cp", "context"), ("pp", "pipeline"), ("ep", "expert")):
        degree = getattr(lay, axis)
        if degree > 1:
            parts.append(f"{name} parallel {axis} {degree}")
    if lay.zero:
        parts.append(f"ZeRO-{lay.zero}")
    return ", ".join(parts) or "plain data parallel"


def recommendation_lines(plan: Plan) -> list[str]:
    """Two lines: the recommendation and why; the fastest that fits and what it trades."""
    best, quick = plan.recommended, fastest_fitting(plan)
    cap = plan.cluster.gpu_memory_bytes / GB
    if best is None:
        return [f"recommended: none; no layout fits in {cap:.0f} GB per GPU (see --all)"]
    step = f"step {_step(best):.3g} s, " if best.time is not None else ""
    lines = [
        f"recommended: {best.layout.label} ({_axes(best)}): {step}"
        f"{best.memory_bytes / GB:.1f} of {cap:.0f} GB per GPU; why: the seeds' rule takes "
        f"the least parallelism that fits ({TIERS[tier(best.layout)]})"
    ]
    if quick is None or quick is best or _step(quick) >= _step(best):
        lines.append("it is also the fastest layout that fits")
        return lines
    gain = 1 - _step(quick) / _step(best)
    lines.append(
        f"fastest that fits: {quick.layout.label} ({_axes(quick)}): step {_step(quick):.3g} s, "
        f"{gain:.0%} less per step, {quick.memory_bytes / GB:.1f} GB per GPU; the "
        f"recommendation trades that speed for {trade(best, quick)}"
    )
    return lines


def trade(best: Estimate, quick: Estimate) -> str:
    """What the slower recommendation keeps that the faster layout gives up."""
    gains = []
    if tier(best.layout) < tier(quick.layout) or best.layout.zero < quick.layout.zero:
        gains.append("fewer parallel axes to run and debug")
    if best.memory_bytes < quick.memory_bytes:
        gains.append(f"{(quick.memory_bytes - best.memory_bytes) / GB:.1f} GB more headroom")
    if best.comm_bytes < quick.comm_bytes:
        gains.append("less traffic per step")
    return " and ".join(gains) or "the seeds' preference order alone (take the fastest)"
