"""Rows of the bytes a rank sends per step, by group, for `plan --validate`: every step
must equal the prediction (plan/rank_traffic.py), the runtime's bookkeeping scalars
labelled; a group carrying the expert all-to-all's tokens, which follow the router and are
predicted for a balanced one, is shown beside it, not checked."""

from __future__ import annotations

from typing import Any

from paratrain.bench.planner.cases import Case, Row, experts_of, small_config
from paratrain.plan.layout import Workload
from paratrain.plan.model import ModelSpec
from paratrain.plan.rank_groups import AXES, RankTraffic, group_name
from paratrain.plan.rank_memory import flat_buffers
from paratrain.plan.rank_traffic import Coords, bytes_by_axis, rank_traffic


def rank_terms(case: Case, m: dict[str, Any], model: ModelSpec, w: Workload) -> list[RankTraffic]:
    """What the planner says this rank sends per step, term by term."""
    c = m["coords"]
    at = Coords(stage=c["pp"], dp_rank=c["dp"], tp_rank=c["tp"], cp_rank=c.get("cp", 0))
    experts = experts_of(small_config(case, 1)) if case.model else None
    return rank_traffic(model, w, case.layout, case.microbatches, at, experts=experts)


def traffic_rows(case: Case, m: dict[str, Any], model: ModelSpec, w: Workload) -> list[Row]:
    """Bytes sent per step by group: every step must equal the prediction, but for a group
    carrying a routed term (the expert all-to-all's tokens), which is explained."""
    terms = rank_terms(case, m, model, w)
    predicted = bytes_by_axis(terms)
    measured = {g for s in m["steps"] for g, _ in s["sent"]}
    rows = []
    for group in [*AXES, "world"]:
        per_step = [sum(v for (g, _), v in s["sent"].items() if g == group) for s in m["steps"]]
        if not predicted.get(group) and group not in measured:
            continue  # nothing predicted, and nothing was sent
        want = predicted.get(group, 0)
        differs = [v for v in per_step if v != want]
        mine = [t for t in terms if t.axis == group and t.bytes]
        note = " + ".join(
            f"{t.what} {t.bytes:,}"
            + (" [runtime]" if t.bookkeeping else "")
            + (" [routed: a balanced router]" if t.routed else "")
            for t in mine
        )
        if group == group_name("dp_cp", case.layout) and case.layout.zero and not case.model:
            note += "; " + zero_formula(case, model, m["coords"]["pp"])
        routed = any(t.routed for t in mine)
        worst = max(per_step, key=lambda v: abs(v - want)) if routed else want
        rows.append(
            Row(
                case.name,
                f"{group} bytes sent/step ({len(per_step)} steps)",
                want,
                worst if routed else (differs[0] if differs else want),
                exact=not routed,
                note=note + (f"; measured {worst / want:.3f} x" if routed else ""),
            )
        )
    return rows


def zero_formula(case: Case, model: ModelSpec, stage: int) -> str:
    """The ZeRO paper's per-rank volume, with S the flat buffers padded to multiples of k."""
    lay, k = case.layout, case.layout.data_ranks
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
