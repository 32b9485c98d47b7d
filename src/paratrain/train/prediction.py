"""The planner's prediction for a run's own layout, and the measurement to put beside it.

`paratrain train` logs, at the start (rank 0), what the planner predicts for this layout:
model state and activations per rank, bytes sent per rank per step by group, the bubble.
At the end every rank reports what it held and sent, and the summary carries both:

    "predicted": {"model_state_bytes": [per rank {params, grads, optimizer, master,
                  total}], "bytes_sent_per_step": [per rank {dp, dp_cp, cp, tp, pp, ep,
                  expert_dp}], "routed_bytes_per_step": [per rank],
                  "calls_per_step": [per rank, by group; None where not predicted],
                  "activation_bytes": [per rank], "bubble_fraction": float or None}
    "measured":  {"model_state_bytes": [...], "bytes_sent_per_step": [...],
                  "calls_per_step": [...], "bytes_sent_total": [per rank, by group,
                  from the start to the last step's end, set-up included], "step": n}

The groups are the comm ledger's names (plan/rank_groups.py): with cp 1 the gradient
group dp_cp is "dp", with ep 1 the experts' expert_dp is the gradient group.

Lists are indexed by global rank. Bytes sent are the last step's, from the comm ledger
between two optimizer steps (the first step also carries set-up: the replicas' initial
parameter broadcast). The measured model state is the runtime's own record at the last
step's end (`TrainResult.extra["model_state_bytes"]`, train/engine.py): tensor sizes for
DataParallel, the flat buffers and shards for ZeRO and FSDP, their padding under params.
The measurement is train/prediction_tracker.py's.
Predictions per rank come from plan/rank_memory.py and plan/rank_traffic.py (calls from
plan/rank_calls.py), exact for our
GPT (ZeRO shards of ceil(n / k) per flat buffer, and that padding), and include the
runtime's bookkeeping scalars; ZeRO-2 follows `parallel.zero2_accumulate` (one gradient
reduce-scatter per step with "full", one per micro-batch with "shard"), and "full"'s
transient whole gradient is a note at the start, not part of the step-boundary record;
activations are Korthikanti's formula (an estimate, see docs/planner.md). Context
parallelism counts every rank's gradient group as dp_cp and its ring or all-to-all bytes
over cp exactly (plan/rank_context.py). A mixture of experts is counted per parameter
share (dense over dp_cp, experts over expert_dp) with its routing traffic exactly, but
for one term: the tokens of the ep all-to-all follow the router's choices, so they are
predicted for a balanced router, said in a note, and reported apart as
`routed_bytes_per_step` (plan/rank_experts.py); its activations are the dense model's.
DiLoCo counts each group as a run of its own, plus the outer step's copies and its
all-reduce across the groups, which the last step (an outer one) records; with outer steps
only every H steps, `bytes_sent_total` gives the whole run's (plan/rank_diloco.py).
Not predicted: the asynchronous parameter server (`--dp-mode async`, nor measured);
sequence parallelism's smaller activations.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

from paratrain.config import RunConfig
from paratrain.mesh import MeshShape
from paratrain.plan import activations, pipeline
from paratrain.plan.layout import SCHEDULES, Layout, Workload
from paratrain.plan.memory import ModelState
from paratrain.plan.model import ModelSpec
from paratrain.plan.rank_calls import rank_calls
from paratrain.plan.rank_compress import POWERSGD_NOTE, compress_state_bytes, powersgd_predicted
from paratrain.plan.rank_diloco import (
    group_coords,
    group_layout,
    outer_elements,
    outer_state,
    within_group,
)
from paratrain.plan.rank_experts import ExpertCounts, expert_model_state
from paratrain.plan.rank_groups import shard_rank
from paratrain.plan.rank_memory import accumulated_gradient_bytes, rank_model_state
from paratrain.plan.rank_traffic import AXES, Coords, RankTraffic, bytes_by_axis, rank_traffic
from paratrain.plan.run_inputs import planner_inputs

log = logging.getLogger(__name__)
STATE_KINDS = ("params", "grads", "optimizer", "master")
MB = 1e6


@dataclass
class Prediction:
    model_state: list[dict[str, int]]  # per global rank
    bytes_per_step: list[dict[str, int]]  # per global rank, by group
    activation_bytes: list[float | None]  # per global rank
    bubble: float | None
    notes: list[str] = field(default_factory=list)
    # per global rank: the part of its bytes that depends on the router's choices (the ep
    # token all-to-all), predicted for a balanced router; the rest is exact
    routed: list[int] = field(default_factory=list)
    # per global rank: calls per group (None where not predicted: plan/rank_calls.py)
    calls_per_step: list[dict[str, int | None]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "model_state_bytes": self.model_state,
            "bytes_sent_per_step": self.bytes_per_step,
            "routed_bytes_per_step": self.routed,
            "calls_per_step": self.calls_per_step,
            "activation_bytes": [None if a is None else round(a) for a in self.activation_bytes],
            "bubble_fraction": self.bubble,
        }


def predict(cfg: RunConfig) -> Prediction:
    """Every rank's prediction, from the planner's pure formulas."""
    model, workload, layout, notes = planner_inputs(cfg)
    experts = ExpertCounts.of(cfg.model)
    shape = MeshShape(
        dp=layout.dp, pp=layout.pp, tp=layout.tp, cp=layout.cp, ep=layout.ep,
        replicas=layout.replicas,
    )  # fmt: skip
    k = cfg.train.microbatches
    states, sent, acts, routed, calls = [], [], [], [], []
    for rank in range(shape.world_size):
        c = shape.coords(rank)
        at = Coords(stage=c["pp"], dp_rank=c["dp"], tp_rank=c["tp"], cp_rank=c["cp"])
        state, terms = _state_and_terms(cfg, model, workload, layout, at, experts)
        states.append(
            {**{kind: getattr(state, kind) for kind in STATE_KINDS}, "total": state.total}
        )
        sent.append(bytes_by_axis(terms))
        routed.append(sum(t.bytes for t in terms if t.routed))
        counted = experts is None and cfg.parallel.dp_mode != "diloco"
        counted = counted and cfg.train.dtype != "float16"  # the scaler's overflow votes
        calls.append(
            rank_calls(model, workload, layout, k, at, cfg.model.dropout)
            if counted
            else dict.fromkeys(AXES)
        )
        acts.append(activations.stage_activation_bytes(model, workload, layout, k, at.stage))
    modelled = layout.pp == 1 or cfg.parallel.schedule in SCHEDULES
    bubble: float | None = pipeline.bubble_fraction(layout.pp, k, layout.chunks, layout.schedule)
    bubble = bubble if modelled else None
    if layout.zero == 2 and layout.dp > 1 and k > 1:
        notes.append(zero2_accumulation_note(model, workload, layout, k))
    if cfg.parallel.compress == "powersgd" and not powersgd_predicted(model, workload):
        notes.append(POWERSGD_NOTE)
    if cfg.parallel.dp_mode == "diloco":
        notes.append("diloco: bytes of an outer step (the last); inner ones send no dp_replicate")
        if cfg.parallel.sync_delay:  # their all-reduces were counted where they started
            notes.append("--sync-delay: the last step's dp_replicate leaves out steps in flight")
    return Prediction(states, sent, acts, bubble, notes, routed, calls)


def _state_and_terms(
    cfg: RunConfig,
    model: ModelSpec,
    workload: Workload,
    layout: Layout,
    at: Coords,
    experts: ExpertCounts | None,
) -> tuple[ModelState, list[RankTraffic]]:
    """A rank's model state at the step boundary and its traffic terms of one step; under
    DiLoCo its group's as a run of its own, with the outer step's (plan/rank_diloco.py)."""
    diloco = cfg.parallel.dp_mode == "diloco"
    inner, here = (group_layout(layout), group_coords(layout, at)) if diloco else (layout, at)
    state = (
        rank_model_state(model, workload, inner, here.stage, shard_rank(inner, here))
        if experts is None
        else expert_model_state(model, experts, workload, inner, here)
    )
    terms = rank_traffic(
        model, workload, inner, cfg.train.microbatches, here, cfg.model.dropout, experts
    )
    if not diloco:  # --compress's error buffers, as gradients (plan/rank_compress.py)
        grads = state.grads + compress_state_bytes(model, workload, layout, at, experts)
        return dataclasses.replace(state, grads=grads), terms
    elements = outer_elements(model, workload, inner, here, experts)
    outer = outer_state(elements, cfg.parallel.outer_momentum > 0)
    state = ModelState(*(getattr(state, k) + getattr(outer, k) for k in STATE_KINDS))
    return state, within_group(terms, layout, at, elements, cfg.parallel.outer_dtype)


def zero2_accumulation_note(model: ModelSpec, workload: Workload, layout: Layout, k: int) -> str:
    """What ZeRO-2's accumulation option costs in this run, beyond the step-boundary record."""
    if workload.zero2_accumulate == "shard":
        return f"ZeRO-2 accumulate shard: a gradient reduce-scatter after each of K = {k}"
    whole = max(accumulated_gradient_bytes(model, workload, layout, k, s) for s in range(layout.pp))
    return (
        f"ZeRO-2 accumulate full: the whole gradient, {whole / MB:.2f} MB, held from the "
        f"first micro-batch's backward to the one reduce-scatter (K = {k})"
    )


def describe_prediction(pred: Prediction, rank: int = 0) -> list[str]:
    """One or two log lines: what the planner expects of `rank`."""
    state, sent, act = (
        pred.model_state[rank],
        pred.bytes_per_step[rank],
        pred.activation_bytes[rank],
    )
    groups = ", ".join(f"{a} {sent[a] / MB:.3f}" for a in AXES if sent[a])
    first = (
        f"plan (rank {rank}): model state {state['total'] / MB:.2f} MB (params "
        f"{state['params'] / MB:.2f}, grads {state['grads'] / MB:.2f}, optimizer "
        f"{state['optimizer'] / MB:.2f}, master {state['master'] / MB:.2f}); activations "
        + ("not counted" if act is None else f"{act / MB:.2f} MB (Korthikanti)")
    )
    bubble = "none" if pred.bubble is None else f"{pred.bubble:.3f}"
    second = (
        f"plan (rank {rank}): sends {sum(sent.values()) / MB:.3f} MB per step"
        + (f" ({groups})" if groups else "")
        + f"; bubble {bubble}"
        + "".join(f"; {n}" for n in pred.notes)
    )
    return [first, second]
