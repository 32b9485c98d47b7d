"""The planner's prediction for a simulated rank, under the measurement's keys, and the
two side by side.

State bytes and bytes per group come from the same per-rank formulas `paratrain train`
compares with its ledger (train/prediction.py `predict`), FLOPs from plan/rank_flops.py
(per pipeline stage and cp coordinate; None where not predicted) and, under Muon, the
Newton-Schulz products of the matrices the rank orthogonalizes (plan/rank_muon.py), and
under --compress powersgd its factors' products (plan/rank_compress.py); calls per group
from plan/rank_calls.py; a checkpoint's bytes from plan/rank_checkpoint.py. Where a
quantity is not predicted: `None` here and "-" in the table. Peak memory: the model
state, the stage's activations on the run's device and what is held beside them, or the
optimizer update's (plan/rank_peak.py), held within 5% of the measured peak
(simulate/memory.py), not exactly: what the planner leaves out is a few temporaries
(docs/planner.md lists them). A peak beyond 5% is flagged in the table and is a
disagreement as an exact quantity's difference is (`differences`: the exit status).
"""

from __future__ import annotations

from typing import Any

from paratrain.config import RunConfig, device_type
from paratrain.mesh import MeshShape
from paratrain.plan.layout import Layout, Workload
from paratrain.plan.model import ModelSpec
from paratrain.plan.muon_peak import muon_step_peak_bytes
from paratrain.plan.peak_state import state_at_peak
from paratrain.plan.rank_checkpoint import checkpoint_bytes
from paratrain.plan.rank_compress import compress_flops
from paratrain.plan.rank_diloco import (
    group_coords,
    group_layout,
    outer_elements,
    outer_state,
    outer_step_peak_bytes,
)
from paratrain.plan.rank_flops import rank_step_flops
from paratrain.plan.rank_muon import muon_flops
from paratrain.plan.rank_peak import rank_peak_bytes, update_peak_bytes
from paratrain.plan.rank_traffic import AXES, Coords
from paratrain.plan.run_inputs import planner_inputs
from paratrain.simulate.memory import CATEGORIES
from paratrain.simulate.roles import mesh_shape
from paratrain.train.prediction import STATE_KINDS, Prediction, predict

MEMORY_KEYS = ("peak", *CATEGORIES)
PEAK_TOLERANCE = 0.05  # the planner's peak within 5% of the measured one (issue 32)


def rank_predictions(cfg: RunConfig, ranks: list[int]) -> dict[int, dict[str, Any]]:
    """{rank: prediction} for each of `ranks`, keyed as `simulate_rank`'s measurement."""
    every: Prediction = predict(cfg)
    model, workload, layout, _ = planner_inputs(cfg)
    shape = mesh_shape(cfg)
    return {
        r: {
            "rank": r,
            **{k: every.model_state[r][k] for k in STATE_KINDS},
            "bytes": dict(every.bytes_per_step[r]),
            "calls": dict(every.calls_per_step[r]),
            "flops": _flops(cfg, model, workload, layout, shape, r),
            "checkpoint": _checkpoint(cfg, model, workload, layout, shape.coords(r)),
            "memory": _memory(cfg, model, workload, layout, shape.coords(r), every.model_state[r]),
        }  # fmt: skip
        for r in ranks
    }


def _memory(
    cfg: RunConfig,
    model: ModelSpec,
    workload: Workload,
    layout: Layout,
    c: dict[str, int],
    state: dict[str, int],
) -> dict[str, int | None]:
    """The planner's peak (plan/rank_peak.py), the larger of the activations', the
    optimizer update's (AdamW's, Muon's) and DiLoCo's outer step's, and the activations
    in it; the measurement's other categories are not predicted."""
    k, device, stage = cfg.train.microbatches, device_type(cfg), c["pp"]
    diloco = cfg.parallel.dp_mode == "diloco"
    alive = state_at_peak(workload, layout, state, cfg.train.steps == 1, k, stage, diloco)
    counted = rank_peak_bytes(model, workload, layout, k, stage, alive, device)
    if counted is None:
        return dict.fromkeys(MEMORY_KEYS)
    peak, acts = counted
    outer = None
    at = Coords(stage=stage, dp_rank=c["dp"], tp_rank=c["tp"], cp_rank=c["cp"])
    if cfg.parallel.dp_mode == "diloco":
        elements = outer_elements(model, workload, group_layout(layout), group_coords(layout, at))
        outer = outer_state(elements, cfg.parallel.outer_momentum > 0)
        p = cfg.parallel
        peak = max(peak, outer_step_peak_bytes(state["total"], outer, p.outer_dtype, p.replicas))
    peak = max(peak, update_peak_bytes(workload, state, device, outer) or 0)
    peak = max(peak, muon_step_peak_bytes(model, workload, layout, at, state, device) or 0)
    return {**dict.fromkeys(MEMORY_KEYS), "peak": round(peak), "activations": round(acts)}


def _checkpoint(
    cfg: RunConfig, model: ModelSpec, workload: Workload, layout: Layout, c: dict[str, int]
) -> int | None:
    """The tensor bytes of the rank's part of a checkpoint (plan/rank_checkpoint.py)."""
    if cfg.parallel.dp_mode == "diloco" or cfg.model.num_experts:
        return None
    at = Coords(stage=c["pp"], dp_rank=c["dp"], tp_rank=c["tp"], cp_rank=c["cp"])
    return checkpoint_bytes(model, workload, layout, at)


def _flops(
    cfg: RunConfig,
    model: ModelSpec,
    workload: Workload,
    layout: Layout,
    shape: MeshShape,
    rank: int,
) -> int | None:
    """The rank's step FLOPs: the model's, and Muon's orthogonalizations it owns."""
    c = shape.coords(rank)
    device = device_type(cfg)
    flops = rank_step_flops(model, workload, layout, c["pp"], c["cp"], cfg.model.dropout, device)
    at = Coords(stage=c["pp"], dp_rank=c["dp"], tp_rank=c["tp"], cp_rank=c["cp"])
    if flops is None:
        return None
    return (
        flops
        + muon_flops(model, workload, layout, at)
        + compress_flops(model, workload, layout, at)
    )


def rows(measured: dict[str, Any], predicted: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(what, measured, predicted) for every quantity; groups where both are zero left out."""
    out = [(k, measured[k], predicted[k]) for k in STATE_KINDS]
    for kind in ("bytes", "calls"):
        for a in AXES:
            m, p = measured[kind][a], predicted[kind][a]
            if m or p:
                out.append((f"{kind} {a}", m, p))
    out.append(("flops", measured["flops"], predicted["flops"]))
    out.append(("checkpoint", measured["checkpoint"], predicted["checkpoint"]))
    return out


def disagreements(measured: dict[str, Any], predicted: dict[str, Any]) -> list[str]:
    """The quantities the planner predicts exactly and the simulation measured otherwise."""
    return [what for what, m, p in rows(measured, predicted) if p is not None and m != p]


def peak_off(measured: dict[str, Any], predicted: dict[str, Any]) -> bool:
    """The planner's peak memory off the measured one by more than PEAK_TOLERANCE of it."""
    m, p = measured["memory"]["peak"], predicted["memory"]["peak"]
    return p is not None and abs(m - p) > PEAK_TOLERANCE * p


def differences(measured: dict[str, Any], predicted: dict[str, Any]) -> list[str]:
    """What makes `simulate` exit 1: the exact quantities that disagree, and the peak
    when it is off by more than the tolerance."""
    peak = ["memory peak"] if peak_off(measured, predicted) else []
    return disagreements(measured, predicted) + peak


def comparison_lines(measured: dict[str, Any], predicted: dict[str, Any]) -> list[str]:
    """One rank's comparison as text lines: what, measured, predicted, difference."""
    lines = [f"rank {measured['rank']}:", f"  {'':16}{'measured':>22}{'predicted':>22}{'diff':>18}"]
    for what, m, p in rows(measured, predicted):
        diff = "-" if p is None else f"{m - p:+,}"
        shown = "-" if p is None else f"{p:,}"
        lines.append(f"  {what:16}{m:>22,}{shown:>22}{diff:>18}")
    for what in MEMORY_KEYS:
        m, p = measured["memory"][what], predicted["memory"][what]
        shown, diff = ("-", "-") if p is None else (f"{p:,}", f"{(m - p) / p:+.1%}")
        flag = "  beyond 5%" if what == "peak" and peak_off(measured, predicted) else ""
        lines.append(f"  {'memory ' + what:16}{m:>22,}{shown:>22}{diff:>18}{flag}")
    return lines
