"""The planner's prediction for a simulated rank, under the measurement's keys, and the
two side by side.

State bytes and bytes per group come from the same per-rank formulas `paratrain train`
compares with its ledger (train/prediction.py `predict`). Not yet predicted per rank, so
`None` here and shown as "-": calls per group (the planner counts bytes, not calls), and
FLOPs, for which the planner has only the whole step's count spread evenly over the
ranks (plan/time.py `model_training_flops`), shown for reference under `flops_even`.
"""

from __future__ import annotations

from typing import Any

from paratrain.config import RunConfig
from paratrain.plan.rank_traffic import AXES
from paratrain.plan.run_inputs import planner_inputs
from paratrain.plan.time import model_training_flops
from paratrain.train.prediction import STATE_KINDS, Prediction, predict


def rank_predictions(cfg: RunConfig, ranks: list[int]) -> dict[int, dict[str, Any]]:
    """{rank: prediction} for each of `ranks`, keyed as `simulate_rank`'s measurement."""
    every: Prediction = predict(cfg)
    model, _, _, _ = planner_inputs(cfg)
    t = cfg.train
    even = model_training_flops(model, t.global_batch * t.seq_len, t.recompute)
    return {
        r: {
            "rank": r,
            **{k: every.model_state[r][k] for k in STATE_KINDS},
            "bytes": dict(every.bytes_per_step[r]),
            "calls": dict.fromkeys(AXES),
            "flops": None,
            "flops_even": round(even / cfg.world_size),
        }
        for r in ranks
    }


def rows(measured: dict[str, Any], predicted: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(what, measured, predicted) for every quantity; groups where both are zero left out."""
    out = [(k, measured[k], predicted[k]) for k in STATE_KINDS]
    for kind in ("bytes", "calls"):
        for a in AXES:
            m, p = measured[kind][a], predicted[kind][a]
            if m or p:
                out.append((f"{kind} {a}", m, p))
    out.append(("flops", measured["flops"], predicted["flops"]))
    out.append(("flops (even share)", measured["flops"], predicted["flops_even"]))
    return out


def disagreements(measured: dict[str, Any], predicted: dict[str, Any]) -> list[str]:
    """The quantities the planner predicts exactly and the simulation measured otherwise."""
    return [what for what, m, p in rows(measured, predicted)[:-1] if p is not None and m != p]


def comparison_lines(measured: dict[str, Any], predicted: dict[str, Any]) -> list[str]:
    """One rank's comparison as text lines: what, measured, predicted, difference."""
    lines = [f"rank {measured['rank']}:", f"  {'':22}{'measured':>18}{'predicted':>18}{'diff':>14}"]
    for what, m, p in rows(measured, predicted):
        diff = "-" if p is None else f"{m - p:+,}"
        shown = "-" if p is None else f"{p:,}"
        lines.append(f"  {what:22}{m:>18,}{shown:>18}{diff:>14}")
    return lines
