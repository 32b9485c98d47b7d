"""Rows of a pipeline's bubble, for `plan --validate`: the slot model and idle slots per
stage (exact, from the schedule's simulation) and each stage's wall clock (explained)."""

from __future__ import annotations

import os
from typing import Any

from paratrain.bench.planner.cases import Case, Row
from paratrain.parallel.pipeline import Costs, build_schedule, check_schedule
from paratrain.plan import pipeline


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
            f"model has equal stages, {'F = B = W' if split else 'B = F'}, free messages"
        )
        if lay.world > (os.cpu_count() or 1):
            note += f"; {lay.world} processes share {os.cpu_count()} cores here"
        rows.append(Row(case.name, f"stage {stage} bubble, wall clock", formula, wall, False, note))
    return rows
