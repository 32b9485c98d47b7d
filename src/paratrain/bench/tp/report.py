"""`paratrain bench tp`'s report: the loss check, ratios and spread, bytes by op on both
sides with each side's gradient-norm traffic apart, and the log lines."""

from __future__ import annotations

import logging
from typing import Any

from paratrain.bench.harness.pairs import check_losses, ratio_summary
from paratrain.config import RunConfig
from paratrain.plan.layout import Layout
from paratrain.plan.rank_traffic import Coords
from paratrain.plan.runtime_scalars import runtime_scalars

log = logging.getLogger(__name__)
LOSS_RTOL = 1e-4  # per step, ours vs the peer: reordered float32 sums (bench/harness/pairs.py)


def summarize(results: list[dict[str, Any]], sp: bool) -> dict[str, Any]:
    """One mode's JSON entry from every rank's result; raises if the losses differ."""
    rows = results[0]["rows"]  # row 0 is the untimed step that counts bytes
    worst = check_losses([r.ours_loss for r in rows], [r.peer_loss for r in rows], LOSS_RTOL)
    timed = rows[1:]
    world = len(results)
    scalars = [  # our step's bookkeeping: the gradient norm's squared sum over tp
        sum(t.bytes for t in runtime_scalars(Layout(tp=world), Coords(tp_rank=r)))
        for r in range(world)
    ]
    return {
        "sequence_parallel": sp,
        "tp": world,
        **ratio_summary([r.ours_s for r in timed], [r.peer_s for r in timed]),
        "bytes_per_rank_per_step": {
            "ours": max(r["ours_bytes"] for r in results),
            "torch": max(r["torch_bytes"] for r in results),
        },
        "bytes_by_rank": {
            "ours": [r["ours_bytes"] for r in results],
            "ours_scalars": scalars,
            "torch": [r["torch_bytes"] for r in results],
            "torch_norm": [r["torch_norm_bytes"] for r in results],
        },
        "ops_per_step": {"ours": results[0]["ours_ops"], "torch": results[0]["torch_ops"]},
        "torch_unsized": results[0]["torch_unsized"],
        "max_param_diff": max(r["max_param_diff"] for r in results),
        "max_loss_rel_diff": worst,
        "final_loss": {"ours": rows[-1].ours_loss, "torch": rows[-1].peer_loss},
    }


def log_report(s: dict[str, Any], peer_plan: str, cfg: RunConfig) -> None:
    m, t = cfg.model, cfg.train
    sp, world = s["sequence_parallel"], s["tp"]
    log.info(
        "GPT %d layers, d_model %d, %d heads, vocabulary %d; batch %d x %d tokens; "
        "AdamW(foreach=True, lr %.3g constant), global norm clipped at %g; tp=%d on gloo, "
        "1 thread each",
        m.n_layer, m.d_model, m.n_head, m.vocab_size, t.global_batch, t.seq_len, t.lr,
        t.grad_clip, world,
    )  # fmt: skip
    log.info(
        "ours: build_engine (apply_tensor_parallel(GPT_TP_PLAN, sequence_parallel=%s)) and "
        "train_step%s",
        sp,
        ", which sums the sequence-parallel gradients" if sp else "",
    )
    log.info(
        "peer: torch DTensor parallelize_module on DeviceMesh('cpu', %s), loss_parallel(); "
        "the norm from get_total_norm(foreach=True) per kind, DTensor's made whole, "
        "clipped by clip_grads_with_norm_(foreach=True) when the clip is above 0; plan:\n%s",
        list(range(world)),
        peer_plan,
    )
    if sp:
        log.info(
            "not matched exactly: the position embedding's gradient (ours: the whole table "
            "in the flat sequence-parallel all-reduce; peer: the looked-up rows all-gathered "
            "in backward); the peer's LayerNorm gradients stay Partial and AdamW's foreach "
            "kernels all-reduce each of them once per kernel that reads it"
        )
    log.info(
        "median step: ours %.4f s, DTensor %.4f s; ratio median %.3f (IQR %.3f-%.3f, "
        "range %.3f-%.3f) over %d pairs",
        s["ours_step_s"], s["torch_step_s"], s["ratio"], s["ratio_q1"], s["ratio_q3"],
        s["ratio_min"], s["ratio_max"], s["pairs"],
    )  # fmt: skip
    for side in ("ours", "torch"):
        ops = ", ".join(
            f"{op} {x['calls']} calls {x['bytes_sent']:,} B"
            for op, x in s["ops_per_step"][side].items()
        )
        log.info(
            "bytes sent per rank per step, %s: %s (%s)",
            side,
            f"{s['bytes_per_rank_per_step'][side]:,}",
            ops,
        )
    by_rank = s["bytes_by_rank"]
    log.info(
        "of which the gradient norm's: ours %s (the step's float64 squared sum over tp), "
        "torch %s (DTensor's norm made whole), per rank",
        by_rank["ours_scalars"],
        by_rank["torch_norm"],
    )
    log.info(
        "losses agree within %.1e relative (tolerance %.0e; final %.5f vs %.5f); "
        "max parameter difference %.2e after %d steps",
        s["max_loss_rel_diff"], LOSS_RTOL, s["final_loss"]["ours"], s["final_loss"]["torch"],
        s["max_param_diff"], s["pairs"] + 1,
    )  # fmt: skip
