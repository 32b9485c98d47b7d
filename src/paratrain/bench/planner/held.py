"""Rows of what a rank holds, for `plan --validate`: model state itemised (exact) and
activations (peak forward graphs exact; bytes within ACTIVATION_TOLERANCE of the planner's
count for fused attention, the variant the runtime runs, Korthikanti's beside it)."""

from __future__ import annotations

from typing import Any

from paratrain.bench.planner.cases import Case, Row, experts_of, small_config
from paratrain.plan import activations, memory
from paratrain.plan.layout import Layout, Workload
from paratrain.plan.model import ModelSpec
from paratrain.plan.rank_experts import expert_model_state
from paratrain.plan.rank_groups import Coords
from paratrain.plan.rank_memory import (
    STATE_KINDS,
    accumulated_gradient_bytes,
    flat_buffers,
    formula_model_state,
    padding_bytes,
    rank_model_state,
)

ACTIVATION_TOLERANCE = 0.10  # the bound; the meter finds the count within 0.1%


def state_rows(case: Case, m: dict[str, Any], model: ModelSpec, w: Workload) -> list[Row]:
    """Itemised model state of the rank's stage, counted exactly (plan/rank_memory.py), against
    the runtime's record; the notes say what the params row adds to memory.py's items."""
    lay, stage = case.layout, m["coords"]["pp"]
    experts = experts_of(small_config(case, 1)) if case.model else None
    if experts is None:
        predicted = rank_model_state(model, w, lay, stage).as_dict()
    else:  # its shares: dense over dp_cp, experts over expert_dp (plan/rank_experts.py)
        c = m["coords"]
        at = Coords(stage=stage, dp_rank=c["dp"], tp_rank=c["tp"], cp_rank=c.get("cp", 0))
        predicted = expert_model_state(model, experts, w, lay, at).as_dict()
    rows = [Row(case.name, f"{kind} bytes", predicted[kind], m[kind]) for kind in STATE_KINDS]
    notes = []
    if experts is not None:
        notes.append("a dense share and an expert share, each its own buffer")
    elif lay.zero:
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
    k = lay.data_ranks
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
    predicted_graphs = activations.in_flight_chunks(case.layout, k, stage)
    rows = [Row(case.name, "peak forward graphs held", predicted_graphs, graphs, note=held + trace)]
    # The variant the runtime runs: fused attention (SDPA keeps no s x s scores), no
    # dropout; all-to-all cp too since 2026-12-07 (it kept its scores before).
    variant = "fused"
    predicted = activations.stage_activation_bytes(model, w, case.layout, k, stage, variant)
    scores = activations.stage_activation_bytes(model, w, case.layout, k, stage)
    assert predicted is not None and scores is not None  # the cases' models have a shape
    sbh = w.micro_batch * model.shape.seq_len * model.shape.d_model * 4  # one fp32 (b, T, C)
    per_layer = activations.block_activation_bytes(model, w, case.layout.tp, variant)
    block = max(s["block_bytes"] for s in steps)
    kind = "fused attention, no s^2 term" if variant == "fused" else "attention's scores kept"
    note = (
        f"{kind}: {measured / predicted:.3f} x the formula; per block "
        f"{block / sbh:.2f} fp32 (b, T, C) tensors saved, the formula {per_layer / sbh:.2f}; "
        f"Korthikanti's count with T x T scores says {scores:,.0f} "
        f"({measured / scores:.2f} x); bound +-{ACTIVATION_TOLERANCE:.0%}"
    )
    bounds: tuple[float, float] | None
    bounds = (predicted * (1 - ACTIVATION_TOLERANCE), predicted * (1 + ACTIVATION_TOLERANCE))
    if case.model:  # a mixture of experts: counted as the dense model, shown, not bounded
        bounds, note = None, "a mixture of experts, counted as the dense model; " + note
    rows.append(
        Row(
            case.name,
            "peak activation bytes",
            round(predicted),
            measured,
            False,
            note,
            bounds=bounds,
        )
    )
    return rows
