"""`paratrain bench muon`: ours against torch.optim.Muon under DDP (zero 0) and under
ZeroRedundancyOptimizer (zero 1), 2 ranks, alternating pairs (compare.py); the bench fails
if the losses differ beyond LOSS_RTOL. Then Muon against AdamW in a training run of the
default model on the default data (curve.py), recorded, not asserted."""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch

from paratrain.bench.harness.pairs import check_mean_losses, ratio_summary
from paratrain.bench.harness.sides import norm_only
from paratrain.bench.muon.compare import PEERS, compare_muon
from paratrain.bench.muon.curve import muon_against_adamw
from paratrain.config import RunConfig
from paratrain.data.tokens import BatchSampler, TokenData, load_tokens
from paratrain.spawn import run_ranks

log = logging.getLogger(__name__)
LOSS_RTOL = 1e-4  # harness/pairs.py's screen for comparable runs
WORLD = 2  # on 2 cores only 2-rank timings mean anything


def run_muon_bench(
    pairs: int = 20,
    steps: int = 300,
    every: int = 50,
    base: RunConfig | None = None,
    data: TokenData | None = None,
) -> dict[str, Any]:
    """`base`: the model and batch (default: `paratrain train`'s); `data`: the tokens
    (default: the embedded default data)."""
    for flag, value in (("--steps", steps), ("--every", every)):
        if value < 1:
            raise ValueError(f"{flag} {value}: must be at least 1")
    torch.set_num_threads(1)
    base = base or RunConfig()
    cfg = norm_only(base)
    cfg.train.optimizer, cfg.train.muon_ns_dtype = "muon", "bfloat16"  # the peer's precision
    cfg.parallel.dp = WORLD
    data = data or load_tokens("")
    t = cfg.train
    sampler = BatchSampler(data.train, t.seq_len, t.global_batch, t.seed)
    global_batches = [sampler.global_batch_at(s) for s in range(pairs + 1)]
    out: dict[str, Any] = {}
    for zero in (0, 1):
        run = copy.deepcopy(cfg)
        run.parallel.zero = zero
        log.info("zero %d peer: %s; gloo, %d ranks, 1 thread each", zero, PEERS[zero], WORLD)
        results = run_ranks(compare_muon, WORLD, global_batches, run, timeout=1800)
        worst = check_mean_losses([r["losses"] for r in results], LOSS_RTOL, f"zero {zero}: ")
        rows = results[0]["rows"]
        summary: dict[str, Any] = {
            **ratio_summary([r.ours_s for r in rows], [r.peer_s for r in rows])
        }
        summary |= {"max_loss_rel_diff": worst, "peer": PEERS[zero]}
        summary["max_param_diff"] = max(r["max_param_diff"] for r in results)
        log.info(
            "zero %d: median step ours %.4f s, torch %.4f s; ratio median %.3f (IQR %.3f-%.3f, "
            "range %.3f-%.3f) over %d pairs; losses within %.1e; max parameter difference %.2e",
            zero, summary["ours_step_s"], summary["torch_step_s"], summary["ratio"],
            summary["ratio_q1"], summary["ratio_q3"], summary["ratio_min"],
            summary["ratio_max"], summary["pairs"], worst, summary["max_param_diff"],
        )  # fmt: skip
        out[f"zero{zero}"] = summary
    torch.set_num_threads(2)
    curve_cfg = copy.deepcopy(base)
    curve_cfg.train.steps = steps
    out["curve"] = muon_against_adamw(curve_cfg, data, every)
    for name, curve in out["curve"]["curves"].items():
        log.info("%s held-out loss by step: %s", name, ", ".join(f"{s}: {v:.4f}" for s, v in curve))
    log.info(
        "AdamW's final held-out loss %.4f; Muon reaches it at step %s of %d",
        out["curve"]["adamw_final"], out["curve"]["muon_reaches_it_at"], steps,
    )  # fmt: skip
    return out
