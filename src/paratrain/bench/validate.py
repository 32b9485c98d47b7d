"""`paratrain plan --validate`: the planner's predictions against real runs, side by side.

Each case trains our small GPT (4 layers, d_model 128, fp32) for a few steps through
`paratrain.train.loop.train` in gloo processes here (validate_measure.py says what each rank
records) and compares, per rank, with the planner (plan/ranks.py, plan/memory.py,
plan/pipeline.py):

- model-state bytes, itemised: exact (tensor sizes; under ZeRO the flat buffers' shards of
  ceil(n / k) and their padding, as the runtime records them in TrainResult.extra);
- bytes sent per step by group (dp, tp, pp), every step: exact (the ledger counts native
  collectives with the ring and chain formulas the planner uses; ZeRO 2 (k-1) S / k per
  step for stages 1-2, (K + 1) (k-1) S / k for stage 2 with accumulate shard,
  3 (k-1) S / k per micro-batch for stage 3, S the padded buffers);
- peak forward graphs held (micro-batches x chunks in flight): exact (the schedule);
- bubble, slot model: exact (the schedule's simulation with F = B = W = 1, B + W unsplit
  outside ZB-H1, against (S-1)/(vK+S-1), or ZB-H1's (S-1+max(0,S-K))/(3K+S-1+max(0,S-K)));
- idle slots per stage: exact (the same simulation against plan/pipeline.bubble_slots);
- bubble, wall clock: explained (where each stage's time went, beside the slot model);
- peak activation bytes: explained (Korthikanti's 16-bit formula against the meter).

A deterministic quantity that differs makes the command exit 1. The runtime's bookkeeping
scalars (the (loss, tokens) pair, the gradient-norm sums, the pipeline's loss broadcast)
are labelled terms of the prediction (plan/ranks.py), not hidden in the comparison.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any

from paratrain.bench.validate_cases import (  # noqa: F401 (CASES, Case: this module's API)
    CASES,
    MICRO_BATCH,
    Case,
    Row,
    model_spec,
    run_case,
    small_config,
    workload_for,
)
from paratrain.plan import memory, pipeline
from paratrain.plan.layout import Layout, Workload
from paratrain.plan.model import ModelSpec
from paratrain.plan.rank_memory import (
    accumulated_gradient_bytes,
    flat_buffers,
    formula_model_state,
    padding_bytes,
    rank_model_state,
)
from paratrain.plan.rank_traffic import Coords, bytes_by_axis, rank_traffic

log = logging.getLogger(__name__)
STATE_KINDS = ("params", "grads", "optimizer", "master")


def state_rows(case: Case, m: dict[str, Any], model: ModelSpec, w: Workload) -> list[Row]:
    """Itemised model state of the rank's stage, counted exactly (plan/ranks.py), against
    the runtime's record; the notes say what the params row adds to memory.py's items."""
    lay, stage = case.layout, m["coords"]["pp"]
    predicted = rank_model_state(model, w, lay, stage).as_dict()
    rows = [Row(case.name, f"{kind} bytes", predicted[kind], m[kind]) for kind in STATE_KINDS]
    notes = []
    if lay.zero:
        notes.append(state_note(lay, model, w, stage))
    if lay.tp * lay.pp > 1:  # what estimate() says per GPU, with its even split
        even = memory.model_state_bytes(model.params, w, lay).params
        notes.append(f"estimate() per GPU splits N evenly: N / (tp pp) x 4 = {even:,}")
    if notes:
        rows[0] = Row(**{**rows[0].__dict__, "note": "; ".join(notes)})
    if lay.zero == 2 and case.microbatches > 1:
        rows[1] = Row(**{**rows[1].__dict__, "note": grads_note(case, model, w, stage)})
    return rows


def grads_note(case: Case, model: ModelSpec, w: Workload, stage: int) -> str:
    """ZeRO-2's gradients at the step boundary, and what its accumulation held before."""
    whole = accumulated_gradient_bytes(model, w, case.layout, case.microbatches, stage)
    if whole:
        return (
            f"a shard at the step boundary; accumulate full held the whole gradient, "
            f"{whole:,} bytes (the buckets), from micro-batch 1 to {case.microbatches}"
        )
    return (
        "a shard; accumulate shard keeps no whole gradient between micro-batches (within a "
        "backward, the unreduced buckets: here one bucket, the whole buffer)"
    )


def state_note(lay: Layout, model: ModelSpec, w: Workload, stage: int) -> str:
    """How the ZeRO params row is made: memory.py's item plus the flat buffers' padding."""
    buffers = [n for chunk in flat_buffers(model, lay, stage) for n in chunk]
    k = lay.dp
    formula = formula_model_state(model, w, lay, stage).params
    pad = {kind: v for kind, v in padding_bytes(model, w, lay, stage).items() if v}
    what = "whole" if lay.zero < 3 else "shard ceil(n/k)"
    units = "FSDP units" if lay.zero == 3 else "chunks, one each"
    shown = (
        f"{len(buffers)} flat buffers ({units}), {sum(buffers):,} parameters"
        if len(buffers) > 1
        else f"n = {buffers[0]:,}, k ceil(n/k) = {k * -(-buffers[0] // k):,}"
    )
    items = " + ".join(f"{kind} {v:,}" for kind, v in pad.items()) or "0"
    return (
        f"{shown}; memory.py params ({what}) {formula:,} + padding {items} "
        "(train/engine.py counts all padding under params)"
    )


def traffic_rows(case: Case, m: dict[str, Any], model: ModelSpec, w: Workload) -> list[Row]:
    """Bytes sent per step by group: every step must equal the prediction."""
    c = m["coords"]
    at = Coords(stage=c["pp"], dp_rank=c["dp"], tp_rank=c["tp"])
    terms = rank_traffic(model, w, case.layout, case.microbatches, at)
    predicted = bytes_by_axis(terms)
    sizes = {"dp": case.layout.dp, "tp": case.layout.tp, "pp": case.layout.pp, "world": 0}
    rows = []
    for group, size in sizes.items():
        per_step = [sum(v for (g, _), v in s["sent"].items() if g == group) for s in m["steps"]]
        if size <= 1 and not any(per_step):
            continue  # a group of one rank sends nothing, and nothing was sent
        want = predicted.get(group, 0)
        differs = [v for v in per_step if v != want]
        note = " + ".join(
            f"{t.what} {t.bytes:,}" + (" [runtime]" if t.bookkeeping else "")
            for t in terms
            if t.axis == group and t.bytes
        )
        if group == "dp" and case.layout.zero:
            note += "; " + zero_formula(case, model, at.stage)
        rows.append(
            Row(
                case.name,
                f"{group} bytes sent/step ({len(per_step)} steps)",
                want,
                differs[0] if differs else want,
                note=note,
            )
        )
    return rows


def zero_formula(case: Case, model: ModelSpec, stage: int) -> str:
    """The ZeRO paper's per-rank volume, with S the flat buffers padded to multiples of k."""
    lay, k = case.layout, case.layout.dp
    padded = sum(k * -(-n // k) for chunk in flat_buffers(model, lay, stage) for n in chunk)
    s_bytes = 4 * padded  # fp32 parameters and fp32 gradient reduction
    if lay.zero == 2 and case.zero2_accumulate == "shard":
        volume = (case.microbatches + 1) * (k - 1) * s_bytes // k
        return (
            f"= (K + 1) (k-1) S / k = {volume:,}: a reduce-scatter every micro-batch, "
            f"K = {case.microbatches}, S = {s_bytes:,} padded"
        )
    if lay.zero < 3:
        return f"= 2 (k-1) S / k, one sync per step, S = {s_bytes:,} padded"
    volume = case.microbatches * 3 * (k - 1) * s_bytes // k
    return f"= K 3 (k-1) S / k = {volume:,}, K = {case.microbatches}, S = {s_bytes:,} padded"


def activation_rows(case: Case, m: dict[str, Any], model: ModelSpec, w: Workload) -> list[Row]:
    stage, k = m["coords"]["pp"], case.microbatches
    steps = m["steps"]
    graphs = max(s["peak_graphs"] for s in steps)
    measured = max(s["peak_bytes"] for s in steps)
    last = steps[-1]
    trace = f"; runtime trace: {last['trace']['trace_peak']}" if "trace" in last else ""
    held = "micro-batch x chunk graphs alive between forward and backward"
    if case.layout.schedule == "zb-h1":  # held until the deferred W, as the runtime does
        graphs = max(s["held_graphs"] for s in steps)
        measured = max(s["held_bytes"] for s in steps)
        held = "graphs kept from F until the deferred W (the meter's bytes, the step replayed)"
        trace += f"; released at B it would be {max(s['peak_graphs'] for s in steps)}"
    predicted_graphs = memory.in_flight_chunks(case.layout, k, stage)
    rows = [Row(case.name, "peak forward graphs held", predicted_graphs, graphs, note=held + trace)]
    predicted = memory.stage_activation_bytes(model, w, case.layout, k, stage)
    sbh = w.micro_batch * model.seq_len * model.d_model * 4  # one fp32 (b, T, C) tensor
    per_layer = memory.layer_activation_bytes(
        model.seq_len, w.micro_batch, model.d_model, model.n_head, case.layout.tp, w.recompute
    )
    block = max(s["block_bytes"] for s in steps)
    note = (
        f"{measured / predicted:.2f} x the formula: per block {block / sbh:.1f} fp32 (b, T, C) "
        f"tensors saved, Korthikanti counts {2 * per_layer / sbh:.1f} (his 16-bit layout with "
        "T x T scores and dropout masks; our fused attention saves no scores, dropout is 0)"
    )
    rows.append(Row(case.name, "peak activation bytes", round(predicted), measured, False, note))
    return rows


def bubble_rows(case: Case, measured: list[dict[str, Any]]) -> list[Row]:
    """Slot model (exact) and wall clock (explained), per stage."""
    from paratrain.parallel.pipeline import Costs, build_schedule, check_schedule

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


def compare(case: Case, measured: list[dict[str, Any]], steps: int) -> list[Row]:
    """Rows of predicted against measured; rows equal on several ranks are merged."""
    cfg = small_config(case, steps)
    model, w = model_spec(cfg), workload_for(cfg)
    rows: list[Row] = []
    for rank, m in enumerate(measured):
        mine = state_rows(case, m, model, w) + traffic_rows(case, m, model, w)
        mine += activation_rows(case, m, model, w)
        rows += [Row(**{**r.__dict__, "ranks": str(rank)}) for r in mine]
    if case.layout.pp > 1:
        rows += bubble_rows(case, measured)
    return merge_ranks(rows)


def merge_ranks(rows: list[Row]) -> list[Row]:
    merged: dict[tuple, Row] = {}
    for r in rows:
        key = (r.case, r.quantity, r.predicted, r.measured, r.note if r.exact else "")
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
        mark = ("yes" if r.ok else "NO") if r.exact else "~"
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
    bad = [r for r in rows if not r.ok]
    exact = [r for r in rows if r.exact]
    names = ", ".join(c.name for c in chosen)
    print(
        f"validate ({names}): {len(exact) - len(bad)} of {len(exact)} exact quantities agree; "
        f"{len(rows) - len(exact)} explained (~)",
        flush=True,
    )
    return 1 if bad else 0
