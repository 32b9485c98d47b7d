"""`paratrain train --trace`: the last training step's pipeline timeline, as files.

Every stage's runtime records its own `StepTrace` (`time.perf_counter`, one clock for all
processes of a machine). The stages of the pipeline that holds global rank 0 (dp and tp
coordinate 0) send theirs to rank 0, one `broadcast_object` per stage over the host-side
control group: S small pickles through `paratrain.comm`, no shared file system needed. Rank 0 writes
`trace.json` (Chrome trace: chrome://tracing, Perfetto) and `timeline.png` (Gantt chart)
with `measure/chrome_trace.py` and `measure/gantt.py`, the same drawing `paratrain schedule`
and `bench pp` use.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from paratrain import comm
from paratrain.config import RunConfig
from paratrain.measure.chrome_trace import write_chrome_trace
from paratrain.measure.gantt import write_gantt
from paratrain.measure.pipeline_spans import spans_from_traces
from paratrain.mesh import Mesh
from paratrain.parallel.pipeline.step_trace import StepTrace

log = logging.getLogger(__name__)

TRACE_FILE = "trace.json"
TIMELINE_FILE = "timeline.png"


def gather_step_traces(mesh: Mesh, trace: StepTrace | None) -> list[StepTrace] | None:
    """Collective over every rank (the control group): the trace of every stage of rank 0's
    pipeline, on rank 0; every other rank gets None."""
    stages = mesh.shape.group_of("pp", 0)  # global ranks, in stage order
    control = mesh.control
    traces = [
        comm.broadcast_object(trace if mesh.global_rank == src else None, control, src)
        for src in stages
    ]
    if mesh.global_rank != 0:
        return None
    if any(t is None for t in traces):
        raise RuntimeError("--trace: a stage recorded no training step")
    return traces


def write_step_timeline(run_dir: Path, traces: list[StepTrace], cfg: RunConfig) -> dict[str, Any]:
    """Write trace.json and timeline.png; return the measured facts per stage."""
    p, t = cfg.parallel, cfg.train
    spans = spans_from_traces(traces, include_comm=True)  # sends/receives on their own row
    bubble = [tr.bubble_fraction() for tr in traces]
    write_chrome_trace(spans, run_dir / TRACE_FILE, p.pp, p.chunks)
    title = (
        f"{p.schedule}: S={p.pp} K={t.microbatches} v={p.chunks}, step {t.steps} "
        "(measured; the pipeline of dp 0, tp 0)"
    )
    write_gantt(spans, run_dir / TIMELINE_FILE, p.pp, p.chunks, title=title, idle=bubble)
    facts = {
        "bubble_measured": bubble,
        "peak_in_flight": [tr.peak_in_flight for tr in traces],
        "peak_in_flight_bytes": [tr.peak_in_flight_bytes for tr in traces],
    }
    log.info("pipeline trace: %s and %s; %s", TRACE_FILE, TIMELINE_FILE, facts)
    return facts


def record_trace(cfg: RunConfig, mesh: Mesh, engine: Any, run_dir: Path) -> dict[str, Any]:
    """Called on every rank after training; returns {"trace": facts} on rank 0, else {}."""
    if not cfg.train.trace or mesh.size("pp") == 1:
        return {}
    traces = gather_step_traces(mesh, engine.runtime.last_train_trace)
    if traces is None:
        return {}
    return {"trace": write_step_timeline(run_dir, traces, cfg)}
