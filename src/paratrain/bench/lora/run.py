"""`paratrain bench lora`: LoRA against full fine-tuning of the same model at 2 ranks
(alternating pairs, steps.py: step time and each side's model state per rank), then a
fine-tuning run both ways from one pre-trained base (curve.py), recorded."""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch

from paratrain.bench.harness.pairs import ratio_summary
from paratrain.bench.lora.curve import fine_tune_curves
from paratrain.bench.lora.steps import lora_against_full
from paratrain.config import RunConfig
from paratrain.data.tokens import BatchSampler, TokenData, load_tokens
from paratrain.spawn import run_ranks

log = logging.getLogger(__name__)
WORLD = 2  # on 2 cores only 2-rank timings mean anything


def run_lora_bench(
    pairs: int = 20,
    rank: int = 8,
    steps: int = 100,
    base_steps: int = 200,
    every: int = 20,
    lora_lr_scale: float = 1.0,
    base: RunConfig | None = None,
    data: TokenData | None = None,
) -> dict[str, Any]:
    """`base`: the model and batch (default: `paratrain train`'s); `data`: the tokens
    (default: the embedded default data). The LoRA run's learning rate is the full
    fine-tune's times `lora_lr_scale` (practice often trains adapters faster)."""
    if not lora_lr_scale > 0:
        raise ValueError(f"--lora-lr-scale {lora_lr_scale}: must be above 0")
    cfg = copy.deepcopy(base or RunConfig())
    cfg.train.lora_rank, cfg.train.lora_alpha = rank, 2.0 * rank
    data = data or load_tokens("")
    t = cfg.train
    sampler = BatchSampler(data.train, t.seq_len, t.global_batch, t.seed)
    global_batches = [sampler.global_batch_at(s) for s in range(pairs + 1)]
    out: dict[str, Any] = {"rank": rank}
    torch.set_num_threads(1)
    for zero in (0, 3):
        run = copy.deepcopy(cfg)
        run.parallel.dp, run.parallel.zero = WORLD, zero
        results = run_ranks(lora_against_full, WORLD, global_batches, run, timeout=1800)
        rows = results[0]["rows"]
        ratios = ratio_summary([r.ours_s for r in rows], [r.peer_s for r in rows])
        summary: dict[str, Any] = {"lora_step_s": ratios.pop("ours_step_s"),
                                   "full_step_s": ratios.pop("torch_step_s"), **ratios}  # fmt: skip
        summary["state"] = results[0]["state"]
        out[f"zero{zero}"] = summary
        lora, full = (sum(summary["state"][k].values()) for k in ("lora", "full"))
        log.info(
            "zero %d, dp %d: median step LoRA %.4f s, full %.4f s; ratio median %.3f (IQR "
            "%.3f-%.3f, range %.3f-%.3f) over %d pairs; model state per rank LoRA %s, full %s "
            "bytes (%.1f%%)",
            zero, WORLD, summary["lora_step_s"], summary["full_step_s"], summary["ratio"],
            summary["ratio_q1"], summary["ratio_q3"], summary["ratio_min"],
            summary["ratio_max"], summary["pairs"], f"{lora:,}", f"{full:,}", 100 * lora / full,
        )  # fmt: skip
    torch.set_num_threads(2)
    curve_cfg = copy.deepcopy(cfg)
    curve_cfg.train.steps = steps
    out["curve"] = fine_tune_curves(curve_cfg, data, base_steps, every, lora_lr_scale)
    out["curve"]["lr"] = {"full": cfg.train.lr, "lora": cfg.train.lr * lora_lr_scale}
    for name, curve in (("base", out["curve"]["base"]), *out["curve"]["curves"].items()):
        log.info("%s held-out loss by step: %s", name, ", ".join(f"{s}: {v:.4f}" for s, v in curve))
    return out
