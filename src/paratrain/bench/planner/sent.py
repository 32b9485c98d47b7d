"""Rows of the bytes a rank sends per step, by group, for `plan --validate`: every step
must equal the prediction (plan/rank_traffic.py), the runtime's bookkeeping scalars labelled."""

from __future__ import annotations

from typing import Any

from paratrain.bench.planner.cases import Case, Row
from paratrain.plan.layout import Workload
from paratrain.plan.model import ModelSpec
from paratrain.plan.rank_memory import flat_buffers
from paratrain.plan.rank_traffic import Coords, bytes_by_axis, rank_traffic


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
