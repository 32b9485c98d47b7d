"""The pipeline's timelines as spans (measure/spans.py), ready to be drawn.

Two sources, one drawing path: a checked schedule's simulated slots (`check_schedule`,
unit costs) and the `StepTrace`s every stage's runtime recorded in one step. Converting
both to Spans lets a simulated and a measured chart of the same schedule look alike.
"""

from __future__ import annotations

from collections.abc import Sequence

from paratrain.measure.spans import COMM, Span
from paratrain.parallel.pipeline.check import Simulation
from paratrain.parallel.pipeline.schedules import BI, BW, COMPUTE, Action, B, F
from paratrain.parallel.pipeline.step_trace import StepTrace

CATEGORY = {F: "forward", B: "backward", BI: "backward-input", BW: "backward-weight"}


def _span(stage: int, action: Action, start: float, end: float) -> Span:
    category = CATEGORY.get(action.kind, COMM)
    return Span(stage, action.kind, category, action.microbatch, action.chunk, start, end)


def spans_from_simulation(sim: Simulation, unit_s: float = 1e-3) -> list[Span]:
    """The simulated slots, one unit of cost taken as `unit_s` seconds (1 ms by default,
    so a Chrome trace of a simulation reads in round milliseconds)."""
    return [
        _span(stage, s.action, s.start * unit_s, s.end * unit_s)
        for stage, row in enumerate(sim.slots)
        for s in row
    ]


def spans_from_traces(traces: Sequence[StepTrace], include_comm: bool = False) -> list[Span]:
    """The recorded events of all stages of one step, relative to the earliest start.

    Communication events are left out unless asked for: a RECV's duration is waiting, which
    the chart shows as idle; a SEND only posts the message.
    """
    if not traces:
        return []
    origin = min(t.start for t in traces)
    return [
        _span(t.stage, e.action, e.start - origin, e.end - origin)
        for t in traces
        for e in t.events
        if include_comm or e.action.kind in COMPUTE
    ]
