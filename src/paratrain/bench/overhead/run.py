"""`paratrain bench overhead`: our training step against a plain PyTorch loop.

Both train their own copy of the same model from the same initial weights on the same
preloaded batches, with the same optimizer flags, clipping, thread count and host syncs
(two `.item()` calls per step): ours is `train_step` through a `FlatEngine` over a
one-rank `DataParallel`, the plain loop the harness's `torch_step` (what one would write
by hand, bench/harness/sides.py). Rounds alternate which loop runs first, and the report
gives the medians of per-step times and their ratio. The two loss curves must agree (they
do the same arithmetic), else the comparison is void and the bench fails.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable

import torch

from paratrain.bench.harness.pairs import check_losses
from paratrain.bench.harness.sides import torch_step
from paratrain.config import RunConfig
from paratrain.data.tokens import BatchSampler, load_tokens
from paratrain.mesh import Mesh
from paratrain.parallel.data_parallel import DataParallel
from paratrain.parallel.data_parallel.adamw import adamw
from paratrain.train.build import build_model, compile_units
from paratrain.train.engine import FlatEngine
from paratrain.train.optim import learning_rate
from paratrain.train.step import train_step

log = logging.getLogger(__name__)
# One rank: no collective reorders a K-term sum (harness/pairs.py's argument), only where
# the step scales the loss differs by a few roundings: ten times tighter than its 1e-4.
LOSS_RTOL = 1e-5
Step = Callable[[int], float]  # step index -> loss


def _timed(fn: Step, steps: range) -> tuple[list[float], list[float]]:
    times, losses = [], []
    for step in steps:
        start = time.perf_counter()
        losses.append(fn(step))
        times.append(time.perf_counter() - start)
    return times, losses


def _loops(cfg: RunConfig, total: int) -> tuple[Step, Step]:
    """(ours, plain): one step each at the scheduled learning rate, on preloaded batches."""
    t = cfg.train
    sampler = BatchSampler(load_tokens("").train, t.seq_len, t.global_batch, t.seed)
    batches = [list(sampler.global_batch_at(s).split(t.micro_batch)) for s in range(total)]
    mesh = Mesh.build(dp=1)  # one process: the dp group has one rank, no communication
    betas = (t.beta1, t.beta2)
    our_model, plain_model = build_model(cfg), build_model(cfg)
    for model in (our_model, plain_model):  # --compile: both sides' blocks, the same way
        compile_units(model, cfg)
    engine = FlatEngine(DataParallel(our_model, mesh.group("dp"), reduce_op="sum"))
    ours_opt = engine.build_optimizer(t.lr, t.weight_decay, betas)
    plain_opt = adamw(plain_model, t.lr, t.weight_decay, betas)

    def lr(step: int) -> float:
        return learning_rate(step, t.lr, t.warmup_steps, total, t.min_lr_ratio)

    def ours(step: int) -> float:
        return train_step(engine, ours_opt, batches[step], lr(step), t.grad_clip).loss

    def plain(step: int) -> float:
        return torch_step(plain_model, plain_opt, batches[step], lr(step), t.grad_clip)

    return ours, plain


def run_overhead_bench(
    steps: int = 20, rounds: int = 7, cfg: RunConfig | None = None
) -> dict[str, float]:
    cfg = cfg or RunConfig()
    t = cfg.train
    t.microbatches = t.global_batch // t.micro_batch  # one process: K = G / b
    ours, plain = _loops(cfg, total=steps * rounds + 1)
    log.info(
        "model: GPT %d layers, d_model %d, seq_len %d, %d micro-batches of %d; %d thread(s)",
        cfg.model.n_layer, cfg.model.d_model, t.seq_len, t.microbatches, t.micro_batch,
        torch.get_num_threads(),
    )  # fmt: skip
    log.info("peer: plain PyTorch loop, AdamW(foreach=True), clip_grad_norm_(foreach=True)")
    if t.compile:
        log.info("both sides: each block compiled (torch.compile, inductor); warm-up compiles")
    ours(0), plain(0)  # warm-up step, not timed
    times: dict[str, list[float]] = {"ours": [], "plain": []}
    losses: dict[str, list[float]] = {"ours": [], "plain": []}
    for r in range(rounds):
        span = range(1 + r * steps, 1 + (r + 1) * steps)
        order = [("ours", ours), ("plain", plain)]
        for name, fn in order if r % 2 == 0 else order[::-1]:
            took, loss = _timed(fn, span)
            times[name] += took
            losses[name] += loss
    check_losses(losses["ours"], losses["plain"], LOSS_RTOL)
    result = {
        "ours_step_s": statistics.median(times["ours"]),
        "plain_step_s": statistics.median(times["plain"]),
        "steps": len(times["ours"]),
        "threads": torch.get_num_threads(),
    }
    result["ratio"] = result["ours_step_s"] / result["plain_step_s"]
    log.info(
        "median step: ours %.4f s, plain %.4f s, ratio %.3f (%d steps each, %d rounds)",
        result["ours_step_s"], result["plain_step_s"], result["ratio"], result["steps"], rounds,
    )  # fmt: skip
    return result
