"""Draw a simulated timeline as text: one row per stage, one cell per time unit.

Cells read `F3` (forward of micro-batch 3), `B3`, `I3`/`W3` (the split backward of
zero-bubble schedules); with several chunks per stage a letter names the chunk (`F3a`,
`F3b`); `.` is idle. An action longer than one unit continues with `=`.
"""

from __future__ import annotations

import math

from paratrain.parallel.pipeline.check import Simulation
from paratrain.parallel.pipeline.schedules import BI, BW

_LETTER = {BI: "I", BW: "W"}


def _label(kind: str, microbatch: int, chunk: int, chunks: int) -> str:
    suffix = chr(ord("a") + chunk) if chunks > 1 else ""
    return f"{_LETTER.get(kind, kind)}{microbatch}{suffix}"


def render_grid(sim: Simulation) -> str:
    """The grid of actions per stage, then the bubble and peak in-flight per stage."""
    durations = [slot.end - slot.start for row in sim.slots for slot in row]
    unit = min(durations, default=1.0)
    width = 1 + max(
        (
            len(_label(s.action.kind, s.action.microbatch, s.action.chunk, sim.schedule.chunks))
            for row in sim.slots
            for s in row
        ),
        default=2,
    )
    cells = math.ceil(sim.makespan / unit - 1e-9)
    lines = []
    for stage, row in enumerate(sim.slots):
        grid = ["." for _ in range(cells)]
        for slot in row:
            first = round(slot.start / unit)
            n = max(1, round((slot.end - slot.start) / unit))
            a = slot.action
            grid[first] = _label(a.kind, a.microbatch, a.chunk, sim.schedule.chunks)
            for i in range(first + 1, first + n):
                grid[i] = "="
        lines.append(f"stage {stage} |" + "".join(c.ljust(width) for c in grid).rstrip())
    sch = sim.schedule
    lines.append(
        f"{sch.name}: S={sch.num_stages} K={sch.num_microbatches} v={sch.chunks}, "
        f"forward {sim.costs.forward:g} backward {sim.costs.backward:g} per chunk; "
        f"bubble {sim.bubble_fraction():.3f}; peak in-flight {list(sim.peak_in_flight)}"
    )
    return "\n".join(lines)
