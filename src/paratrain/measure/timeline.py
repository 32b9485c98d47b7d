"""Pipeline timelines as a Chrome trace (JSON) and a Gantt chart (PNG).

Both views draw the same thing from either source: a schedule's simulated slots
(`check_schedule(...)`, unit costs) or the `StepTrace`s every stage's runtime recorded in
one step (`time.perf_counter`, one clock for all processes of a machine, so traces of
different ranks line up without any clock exchange). Converting both to `Span`s first
keeps one drawing path, so a simulated and a measured chart of the same schedule look
alike and can be put side by side.

Names follow the text grid of `render`: `F3` is the forward of micro-batch 3, `B3` its
backward, `BI3` / `BW3` the split halves; with several chunks per stage the chunk is
appended, `F3c1`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paratrain.parallel.pipeline.check import Simulation
from paratrain.parallel.pipeline.runtime import StepTrace
from paratrain.parallel.pipeline.schedules import BI, BW, COMPUTE, B, F

CATEGORY = {F: "forward", B: "backward", BI: "backward-input", BW: "backward-weight"}
# Colour-blind-safe (Okabe-Ito); chunk c > 0 is drawn hatched in the same colour.
COLOUR = {F: "#0072B2", B: "#D55E00", BI: "#E69F00", BW: "#009E73", "comm": "#999999"}
IDLE_COLOUR = "#EEEEEE"


@dataclass(frozen=True)
class Span:
    """One action of one stage on a common time axis, in seconds from the step's start."""

    stage: int
    kind: str  # F, B, BI, BW, or a communication kind (SEND_F, RECV_B, ...)
    microbatch: int
    chunk: int
    start: float
    end: float

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE


def span_name(span: Span, chunks: int) -> str:
    """`F3`, `BW0`, or with several chunks per stage `F3c1`."""
    return f"{span.kind}{span.microbatch}" + (f"c{span.chunk}" if chunks > 1 else "")


def spans_from_simulation(sim: Simulation, unit_s: float = 1e-3) -> list[Span]:
    """The simulated slots, one unit of cost taken as `unit_s` seconds (1 ms by default,
    so a Chrome trace of a simulation reads in round milliseconds)."""
    return [
        Span(
            stage,
            s.action.kind,
            s.action.microbatch,
            s.action.chunk,
            s.start * unit_s,
            s.end * unit_s,
        )
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
        Span(
            t.stage,
            e.action.kind,
            e.action.microbatch,
            e.action.chunk,
            e.start - origin,
            e.end - origin,
        )
        for t in traces
        for e in t.events
        if include_comm or e.action.kind in COMPUTE
    ]


def idle_fractions(spans: Sequence[Span], num_stages: int) -> list[float]:
    """Per stage, time not computing over the whole window (first start to last end)."""
    if not spans:
        return [0.0] * num_stages
    start, end = min(s.start for s in spans), max(s.end for s in spans)
    window = end - start
    busy = [0.0] * num_stages
    for s in spans:
        if s.is_compute:
            busy[s.stage] += s.end - s.start
    return [1.0 - b / window if window > 0 else 0.0 for b in busy]


def _metadata(kind: str, pid: int, tid: int, **args: Any) -> dict[str, Any]:
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": args}


def chrome_trace(spans: Sequence[Span], num_stages: int, chunks: int = 1) -> dict[str, Any]:
    """The trace-event format read by chrome://tracing and Perfetto.

    One process per stage (`pid` = stage, named "stage s"), compute on thread 0 and, when
    present, communication on thread 1, so waiting shows as gaps on the compute row.
    Complete events ("ph": "X") with `ts` and `dur` in microseconds.
    """
    events: list[dict[str, Any]] = []
    for stage in range(num_stages):
        events.append(_metadata("process_name", stage, 0, name=f"stage {stage}"))
        events.append(_metadata("process_sort_index", stage, 0, sort_index=stage))
        events.append(_metadata("thread_name", stage, 0, name="compute"))
        events.append(_metadata("thread_name", stage, 1, name="comm"))
    for s in sorted(spans, key=lambda s: (s.stage, s.start)):
        events.append(
            {
                "name": span_name(s, chunks),
                "cat": CATEGORY.get(s.kind, "comm"),
                "ph": "X",
                "ts": round(s.start * 1e6, 3),
                "dur": round((s.end - s.start) * 1e6, 3),
                "pid": s.stage,
                "tid": 0 if s.is_compute else 1,
                "args": {"kind": s.kind, "microbatch": s.microbatch, "chunk": s.chunk},
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(
    spans: Sequence[Span], path: str | Path, num_stages: int, chunks: int = 1
) -> Path:
    """Write `chrome_trace(...)` as JSON to `path` (parent folders created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(spans, num_stages, chunks)))
    return path


def write_gantt(
    spans: Sequence[Span],
    path: str | Path,
    num_stages: int,
    chunks: int = 1,
    title: str = "",
    idle: Sequence[float] | None = None,
    time_unit: str = "ms",
) -> Path:
    """A PNG Gantt chart: one row per stage, stage 0 on top, idle time as grey background.

    Forward, backward and the two halves of a split backward have distinct colours; chunks
    after the first are hatched. `idle` (per stage, e.g. the runtime's own measured
    bubble) is written at the right of each row; by default it is computed from the spans.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    from matplotlib import pyplot as plt
    from matplotlib.patches import Patch

    scale = {"s": 1.0, "ms": 1e3, "us": 1e6, "slots": 1.0}[time_unit]
    compute = [s for s in spans if s.is_compute]
    idle = list(idle) if idle is not None else idle_fractions(compute, num_stages)
    end = max((s.end for s in compute), default=1.0) * scale
    fig, ax = plt.subplots(figsize=(10, 0.9 + 0.55 * num_stages), dpi=100)
    for stage in range(num_stages):  # y = S - 1 - stage puts stage 0 on top
        ax.barh(num_stages - 1 - stage, end, left=0, height=0.8, color=IDLE_COLOUR)
        ax.text(
            end * 1.01, num_stages - 1 - stage, f"idle {idle[stage]:.0%}", va="center", fontsize=8
        )
    for s in compute:
        left, width = s.start * scale, (s.end - s.start) * scale
        y = num_stages - 1 - s.stage
        ax.barh(
            y,
            width,
            left=left,
            height=0.8,
            color=COLOUR[s.kind],
            edgecolor="white",
            linewidth=0.5,
            hatch="//" if s.chunk > 0 else None,
        )
        if width > end / 60:  # label only bars wide enough to hold it
            ax.text(
                left + width / 2,
                y,
                str(s.microbatch),
                ha="center",
                va="center",
                fontsize=6,
                color="white",
            )
    ax.set_yticks(range(num_stages), [f"stage {s}" for s in reversed(range(num_stages))])
    ax.set_xlim(0, end * 1.1)
    ax.set_xlabel(f"time ({time_unit})")
    kinds = [k for k in (F, B, BI, BW) if any(s.kind == k for s in compute)]
    handles = [Patch(color=COLOUR[k], label=CATEGORY[k]) for k in kinds]
    handles.append(Patch(color=IDLE_COLOUR, label="idle"))
    if chunks > 1:
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="chunk > 0"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.35 / (0.9 + 0.55 * num_stages), 1, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
