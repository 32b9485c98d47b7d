"""`paratrain plan --validate`: the planner's predictions against real runs, side by side.

Each case trains our small GPT (4 layers, d_model 128, fp32; the `ep` case moe-tiny) for
a few steps through `paratrain.train.loop.train` in gloo processes here (cases.py;
record.py says what each rank records) and compares, per rank, with the planner
(plan/rank_memory.py, plan/rank_traffic.py, plan/memory.py, plan/activations.py,
plan/pipeline.py), one row per quantity (held.py, sent.py, bubbles.py):

- model-state bytes, itemised: exact (tensor sizes; under ZeRO the flat buffers' shards of
  ceil(n / k) and their padding, as the runtime records them in TrainResult.extra);
- bytes sent per step by group (dp or dp_cp, cp, tp, pp, ep, expert_dp), every step:
  exact (the ledger counts native collectives with the ring and chain formulas the
  planner uses; ZeRO 2 (k-1) S / k per step for stages 1-2, (K + 1) (k-1) S / k for
  stage 2 with accumulate shard, 3 (k-1) S / k per micro-batch for stage 3, S the padded
  buffers), except a group carrying the expert all-to-all's tokens, which follow the
  router and are predicted for a balanced one: explained;
- peak forward graphs held (micro-batches x chunks in flight): exact (the schedule);
- bubble, slot model: exact (the schedule's simulation with F = B = W = 1, B + W unsplit
  outside ZB-H1, against (S-1)/(vK+S-1), or ZB-H1's (S-1+max(0,S-K))/(3K+S-1+max(0,S-K)));
- idle slots per stage: exact (the same simulation against plan/pipeline.bubble_slots);
- bubble, wall clock: explained (where each stage's time went, beside the slot model);
- peak activation bytes: explained (Korthikanti's 16-bit formula against the meter).

A deterministic quantity that differs makes the command exit 1. The runtime's bookkeeping
scalars (the (loss, tokens) pair, the gradient-norm sums, the pipeline's loss broadcast)
are labelled terms of the prediction (plan/rank_traffic.py), not hidden in the comparison.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from paratrain.bench.planner.bubbles import bubble_rows
from paratrain.bench.planner.cases import (
    CASES,
    Case,
    Row,
    small_config,
)
from paratrain.bench.planner.held import activation_rows, state_rows
from paratrain.bench.planner.on_wire import wire_rows
from paratrain.bench.planner.record import run_case
from paratrain.bench.planner.sent import traffic_rows
from paratrain.plan.run_inputs import planner_inputs


def compare(case: Case, measured: list[dict[str, Any]], steps: int) -> list[Row]:
    """Rows of predicted against measured; rows equal on several ranks are merged."""
    cfg = small_config(case, steps)
    model, w, _, _ = planner_inputs(cfg)
    rows: list[Row] = []
    for rank, m in enumerate(measured):
        mine = state_rows(case, m, model, w) + traffic_rows(case, m, model, w)
        mine += wire_rows(case, m, model, w)
        mine += activation_rows(case, m, model, w)
        rows += [Row(**{**r.__dict__, "ranks": str(rank)}) for r in mine]
    if case.layout.pp > 1:
        rows += bubble_rows(case, measured)
    return merge_ranks(rows)


def merge_ranks(rows: list[Row]) -> list[Row]:
    merged: dict[tuple, Row] = {}
    for r in rows:
        key = (r.case, r.quantity, r.predicted, r.measured, r.note if r.exact else "", r.bounds)
        if key in merged and r.ranks:
            old = merged[key]
            merged[key] = Row(**{**old.__dict__, "ranks": f"{old.ranks},{r.ranks}"})
        else:
            merged[key] = r
    return list(merged.values())


def _value(x: float) -> str:
    return f"{x:,.0f}" if float(x).is_integer() or abs(x) >= 100 else f"{x:.4f}"


def format_rows(rows: list[Row]) -> str:
    head = f"{'case':<14} {'ranks':<16} {'quantity':<34} {'predicted':>13} {'measured':>13}  ok"
    lines = [head]
    for r in rows:
        mark = ("yes" if r.ok else "NO") if r.checked else "~"
        lines.append(
            f"{r.case:<14} {r.ranks or 'all':<16} {r.quantity:<34} {_value(r.predicted):>13} "
            f"{_value(r.measured):>13}  {mark:<3}" + (f" {r.note}" if r.note else "")
        )
    return "\n".join(lines)


def select_cases(names: Iterable[str] | None) -> list[Case]:
    if names is None:
        return list(CASES.values())
    wanted = [n.strip() for n in names if n.strip()]
    unknown = [n for n in wanted if n not in CASES]
    if unknown or not wanted:
        raise ValueError(
            f"validate cases {', '.join(unknown) or '(none)'} unknown; valid: {', '.join(CASES)}"
        )
    return [CASES[n] for n in wanted]


def run_validation(steps: int = 3, cases: Iterable[str] | None = None) -> int:
    """Run the cases, print the table; 0 when every deterministic quantity agrees, else 1."""
    chosen = select_cases(cases)
    rows: list[Row] = []
    for case in chosen:
        rows += compare(case, run_case(case, steps), steps)
    print(format_rows(rows), flush=True)
    exact = [r for r in rows if r.exact]
    bounded = [r for r in rows if r.bounds is not None]
    names = ", ".join(c.name for c in chosen)
    print(
        f"validate ({names}): {sum(r.ok for r in exact)} of {len(exact)} exact quantities "
        f"agree; {sum(r.ok for r in bounded)} of {len(bounded)} measured quantities within "
        f"their stated bounds; {len(rows) - len(exact) - len(bounded)} explained (~)",
        flush=True,
    )
    bad = [r for r in rows if not r.ok]
    return 1 if bad else 0
