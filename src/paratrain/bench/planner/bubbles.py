"""Rows of a pipeline's bubble, for `plan --validate`: the slot model and idle slots per
stage (exact, from the schedule's simulation), the bubble measured from the runtime's own
timestamps (within a stated bound) and where each stage's time went (explained).

Measured bubble, the planner's definition (plan/pipeline.py: the fraction of the step a
stage is idle, all stages alike): per pipeline and step,

    bubble = 1 - sum over stages of busy / (S x makespan)

busy = the time inside the runtime's compute actions (F, B, BI, BW) of the stage's trace,
makespan = the last stage's end - the first stage's start of that step (the traces share
the machine's one clock). Averaged over the steps after the first (which pays for warm-up
allocations) and over the pipelines of the case. The case's passes are slowed by a sleep
(slowdown.py) so that they are equal and long next to this machine's noise; the bound,
BUBBLE_TOLERANCE either side, is what remains: messages (a few ms a step), the stages'
unequal real compute (the last holds the head) and the scheduler on 2 shared cores.
Measured here: 1F1B 0.198-0.208, interleaved 0.13-0.15 (0.111), ZeRO pipelines and 3D
0.207-0.222 (0.2); GPipe 0.226-0.260 (0.2), whose last stage spends about 8% of its step
outside any action and starts each step late, for reasons not pinned down: hence 0.075.
"""

from __future__ import annotations

import os
from typing import Any

from paratrain.bench.planner.cases import SLOW_UNIT_S, Case, Row
from paratrain.parallel.pipeline import Costs, build_schedule, check_schedule
from paratrain.plan import pipeline

BUBBLE_TOLERANCE = 0.075  # absolute, either side of the formula (module docstring)


def runtime_bubble(measured: list[dict[str, Any]]) -> tuple[float, float, int]:
    """(bubble, mean makespan in s, samples): the module docstring's definition."""
    pipes: dict[tuple[int, int, int], list[dict[str, Any]]] = {}
    for m in measured:
        c = m["coords"]
        for i, s in enumerate(m["steps"][1:] or m["steps"]):
            pipes.setdefault((c["dp"], c["tp"], i), []).append(s["trace"])
    bubbles, spans = [], []
    for traces in pipes.values():
        span = max(t["end"] for t in traces) - min(t["start"] for t in traces)
        bubbles.append(1 - sum(t["busy_s"] for t in traces) / (len(traces) * span))
        spans.append(span)
    return sum(bubbles) / len(bubbles), sum(spans) / len(spans), len(bubbles)


def bubble_rows(case: Case, measured: list[dict[str, Any]]) -> list[Row]:
    """Slot model (exact) and wall clock (explained), per stage."""
    lay, k = case.layout, case.microbatches
    schedule = build_schedule(lay.schedule, lay.pp, k, lay.chunks)
    formula = pipeline.bubble_fraction(lay.pp, k, lay.chunks, lay.schedule)
    sim = check_schedule(schedule, Costs(forward=1.0, backward=2.0))  # F = B = W = 1
    rows = [Row(case.name, "bubble, slot model", formula, sim.bubble_fraction())]
    slots = pipeline.bubble_slots(lay.pp, k, lay.chunks, lay.schedule)
    idle = [sim.makespan - sim.busy(stage) for stage in range(lay.pp)]
    differs = [x for x in idle if x != slots]
    note = f"per stage, F = B = W = 1, busy 3vK = {3 * lay.chunks * k}"
    if lay.schedule == "zb-h1":
        note += f"; 1F1B idles 3 (S-1) = {3 * (lay.pp - 1)}: (S-1) + max(0, S-K) here"
    rows.append(
        Row(case.name, "idle slots per stage", slots, differs[0] if differs else slots, note=note)
    )
    bubble, span, samples = runtime_bubble(measured)
    unit = "F = B = W" if lay.schedule == "zb-h1" else "B = 2F"
    note = (
        f"1 - busy / (S x makespan) from the runtime's timestamps, {samples} pipeline steps, "
        f"makespan {1e3 * span:.0f} ms; passes slowed to {unit}, F = {1e3 * SLOW_UNIT_S:.0f} "
        f"ms of sleep; bound +-{BUBBLE_TOLERANCE}"
    )
    bounds: tuple[float, float] | None = (formula - BUBBLE_TOLERANCE, formula + BUBBLE_TOLERANCE)
    if lay.schedule == "zb-h1":  # explained, not bounded: the first stage has no B pass
        bounds = None
        note += (
            "; not bounded: the runtime skips the first stage's input-gradient pass (no "
            "stage before it needs one), so stage 0 works F + W, 2 units a micro-batch, where "
            "the formula has 3, and waits for stage 1 the rest"
        )
    rows.append(Row(case.name, "bubble, runtime", formula, bubble, False, note, bounds=bounds))
    return rows + stage_wall_rows(case, measured, formula)


def stage_wall_rows(case: Case, measured: list[dict[str, Any]], formula: float) -> list[Row]:
    """Each stage's idle share of the wall clock, explained by where the time went."""
    lay, rows = case.layout, []
    traces = [  # the first step pays for warm-up allocations
        (m["coords"]["pp"], s["trace"]) for m in measured for s in m["steps"][1:] or m["steps"]
    ]
    for stage in range(lay.pp):
        mine = [t for s, t in traces if s == stage]

        def share(key: str, mine: list = mine) -> float:
            return sum(t[key] for t in mine) / sum(t["span_s"] for t in mine)

        wall = 1 - share("busy_s")  # idle over the schedule's span, over steps and ranks

        waits = sum(t["receives"] for t in mine) // len(mine)
        recv, send = share("recv_s"), share("send_s")

        def ms(key: str, mine: list = mine) -> float:
            return 1e3 * sum(t[key] for t in mine) / len(mine)

        split = lay.schedule == "zb-h1"
        passes = (
            f"B {ms('input_s'):.1f}, W {ms('weight_s'):.1f}"
            if split
            else f"B {ms('backward_s'):.1f}"
        )
        note = (
            f"busy {ms('busy_s'):.0f} of {ms('span_s'):.0f} ms (F {ms('forward_s'):.1f}, "
            f"{passes} ms per chunk); idle = waiting in {waits} receives "
            f"{recv:.3f} + posting sends {send:.3f} + other {wall - recv - send:.3f}; the slot "
            f"model has equal stages, {'F = B = W' if split else 'B = 2F'}, free messages"
        )
        if lay.world > (os.cpu_count() or 1):
            note += f"; {lay.world} processes share {os.cpu_count()} cores here"
        rows.append(Row(case.name, f"stage {stage} bubble, wall clock", formula, wall, False, note))
    return rows
