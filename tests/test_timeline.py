"""Timelines as Chrome traces and Gantt PNGs, from simulated schedules and recorded traces.

Pure: no processes, no process groups. The recorded traces here are built by hand with
the runtime's own `StepTrace` / `Event` types, so the conversion is tested on exactly the
data a run produces.
"""

from __future__ import annotations

import json

import pytest

from paratrain.measure.chrome_trace import chrome_trace, write_chrome_trace
from paratrain.measure.gantt import write_gantt
from paratrain.measure.pipeline_spans import spans_from_simulation, spans_from_traces
from paratrain.measure.spans import idle_fractions, span_name
from paratrain.parallel.pipeline import (
    Action,
    Event,
    StepTrace,
    build_schedule,
    check_schedule,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def simulate(name: str, stages: int, k: int, chunks: int = 1):
    return check_schedule(build_schedule(name, stages, k, chunks))


def test_chrome_trace_has_one_process_per_stage_and_every_compute_action():
    sim = simulate("1f1b", 4, 8)
    trace = chrome_trace(spans_from_simulation(sim), num_stages=4)
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {s: f"stage {s}" for s in range(4)}
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == 4 * 8 * 2  # every forward and backward of every stage
    for stage in range(4):
        mine = [e["name"] for e in complete if e["pid"] == stage]
        assert sorted(mine) == sorted([f"F{i}" for i in range(8)] + [f"B{i}" for i in range(8)])
    # One slot = 1 ms by default: unit costs give whole milliseconds, in microseconds.
    assert all(e["dur"] == 1000.0 and e["ts"] % 1000 == 0 for e in complete)
    first = min((e for e in complete if e["pid"] == 3), key=lambda e: e["ts"])
    assert (first["name"], first["ts"], first["cat"]) == ("F0", 3000.0, "forward")


def test_interleaved_names_carry_the_chunk_and_split_backward_its_halves():
    sim = simulate("interleaved", 2, 4, 2)
    names = {e["name"] for e in chrome_trace(spans_from_simulation(sim), 2, 2)["traceEvents"]}
    assert {"F3c1", "F0c0", "B2c1"} <= names
    zb = chrome_trace(spans_from_simulation(simulate("zb-h1", 2, 4)), 2)["traceEvents"]
    cats = {e["name"][:2]: e["cat"] for e in zb if e["ph"] == "X"}
    assert cats == {
        "F0": "forward",
        "F1": "forward",
        "F2": "forward",
        "F3": "forward",
        "BI": "backward-input",
        "BW": "backward-weight",
    }


def test_idle_from_spans_equals_the_simulated_bubble():
    for name, s, k, v in (("gpipe", 4, 4, 1), ("interleaved", 4, 8, 2), ("zb-h1", 3, 6, 1)):
        sim = simulate(name, s, k, v)
        idle = idle_fractions(spans_from_simulation(sim), s)
        assert idle == pytest.approx([sim.bubble_fraction(i) for i in range(s)])


def recorded_step() -> list[StepTrace]:
    """Two stages of a 1-micro-batch step as the runtime records it (absolute clock)."""
    t0 = 1000.0
    stage0 = StepTrace(0, t0, t0 + 0.010)
    stage0.events += [
        Event(Action("F", 0), t0, t0 + 0.002),
        Event(Action("SEND_F", 0, 0, 1), t0 + 0.002, t0 + 0.0021),
        Event(Action("RECV_B", 0, 0, 1), t0 + 0.0021, t0 + 0.007),  # waiting
        Event(Action("B", 0), t0 + 0.007, t0 + 0.010),
    ]
    stage1 = StepTrace(1, t0 + 0.0005, t0 + 0.008)
    stage1.events += [
        Event(Action("RECV_F", 0, 0, 0), t0 + 0.0005, t0 + 0.0022),
        Event(Action("F", 0), t0 + 0.0022, t0 + 0.004),
        Event(Action("B", 0), t0 + 0.004, t0 + 0.0068),
        Event(Action("SEND_B", 0, 0, 0), t0 + 0.0068, t0 + 0.0069),
    ]
    return [stage0, stage1]


def test_recorded_traces_share_one_origin_and_leave_waiting_out():
    spans = spans_from_traces(recorded_step())
    assert [(s.stage, s.kind) for s in spans] == [(0, "F"), (0, "B"), (1, "F"), (1, "B")]
    assert spans[0].start == 0.0
    assert spans[2].start == pytest.approx(0.0022)  # stage 1's clock, same origin
    with_comm = spans_from_traces(recorded_step(), include_comm=True)
    assert len(with_comm) == 8
    trace = chrome_trace(with_comm, 2)
    recv = next(e for e in trace["traceEvents"] if e.get("args", {}).get("kind") == "RECV_B")
    assert (recv["tid"], recv["cat"], recv["dur"]) == (1, "comm", pytest.approx(4900.0))
    assert idle_fractions(spans, 2) == pytest.approx([1 - 0.005 / 0.010, 1 - 0.0046 / 0.010])
    assert spans_from_traces([]) == []


def test_files_are_written(tmp_path):
    sim = simulate("interleaved", 4, 8, 2)
    spans = spans_from_simulation(sim, unit_s=1.0)
    png = write_gantt(spans, tmp_path / "deep" / "sim.png", 4, 2, "interleaved", None, "slots")
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert png.stat().st_size < 200_000  # small enough to commit under docs/img
    measured = write_gantt(
        spans_from_traces(recorded_step()),
        tmp_path / "m.png",
        2,
        idle=[t.bubble_fraction() for t in recorded_step()],
    )
    assert measured.read_bytes()[:8] == PNG_MAGIC
    path = write_chrome_trace(spans_from_simulation(sim), tmp_path / "t.json", 4, 2)
    loaded = json.loads(path.read_text())
    assert loaded["displayTimeUnit"] == "ms"
    assert sum(e["ph"] == "X" for e in loaded["traceEvents"]) == 4 * 8 * 2 * 2


def test_span_names():
    (span,) = spans_from_traces([StepTrace(0, 0.0, 1.0, [Event(Action("BW", 3, 1), 0.0, 1.0)])])
    assert span_name(span, chunks=2) == "BW3c1"
    assert span_name(span, chunks=1) == "BW3"
