"""`paratrain bench overhead`: our training step against a plain PyTorch loop.

Both train their own copy of the same model from the same initial weights on the same
preloaded batches, with the same optimizer flags, clipping, thread count and host syncs
(two `.item()` calls per step): ours is `train_step` through a `FlatEngine` over a
one-rank `DataParallel`, the plain loop the harness's `torch_step` (what one would write
by hand, bench/harness/sides.py). Rounds alternate which loop runs first, and the report
gives the medians of per-step times and their ratio. The two loss curves must agree (they
do the same arithmetic), else the comparison is void and the bench fails.

`peer="transformers"`: the plain loop trains transformers' model of the same
architecture holding our initial weights (bench/model/peer.py), so the loop and the model
are both someone else's. Its arithmetic is the same function in another order, and AdamW
amplifies the roundings over the steps: the losses are held to the whole-step screen of
`bench model` (STEP_LOSS_RTOL).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from paratrain.bench.harness.pairs import check_losses
from paratrain.bench.harness.sides import torch_step
from paratrain.bench.model.peer import transformers_twin
from paratrain.bench.model.run import STEP_LOSS_RTOL
from paratrain.bench.overhead.profile import log_differences, op_differences
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
PEER_LOOP = "plain PyTorch loop, AdamW(foreach=True), clip_grad_norm_(foreach=True)"


def _timed(fn: Step, steps: range) -> tuple[list[float], list[float]]:
    times, losses = [], []
    for step in steps:
        start = time.perf_counter()
        losses.append(fn(step))
        times.append(time.perf_counter() - start)
    return times, losses


def _loops(cfg: RunConfig, total: int, peer: str) -> tuple[Step, Step, str]:
    """(ours, plain, what the plain side is): one step each at the scheduled learning
    rate, on preloaded batches."""
    t = cfg.train
    sampler = BatchSampler(load_tokens("").train, t.seq_len, t.global_batch, t.seed)
    batches = [list(sampler.global_batch_at(s).split(t.micro_batch)) for s in range(total)]
    mesh = Mesh.build(dp=1)  # one process: the dp group has one rank, no communication
    betas = (t.beta1, t.beta2)
    our_model = build_model(cfg)
    plain_model: nn.Module
    if peer == "transformers":  # our initial weights in transformers' model
        plain_model, line = transformers_twin(cfg.model, our_model)
        what = f"{PEER_LOOP}, over {line}"
    else:
        plain_model, what = build_model(cfg), PEER_LOOP
    for model in (our_model, plain_model):  # --compile (plain peer): both sides' blocks
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

    return ours, plain, what


def run_overhead_bench(
    steps: int = 20,
    rounds: int = 7,
    cfg: RunConfig | None = None,
    peer: str = "plain",
    profile_steps: int = 0,
) -> dict[str, Any]:
    """profile_steps: after the timing, profile that many more steps of each loop and list
    the ops that differ (profile.py)."""
    cfg = cfg or RunConfig()
    t = cfg.train
    t.microbatches = t.global_batch // t.micro_batch  # one process: K = G / b
    timed = steps * rounds + 1
    ours, plain, what = _loops(cfg, total=timed + profile_steps, peer=peer)
    log.info(
        "model: GPT %d layers, d_model %d, seq_len %d, %d micro-batches of %d; %d thread(s)",
        cfg.model.n_layer, cfg.model.d_model, t.seq_len, t.microbatches, t.micro_batch,
        torch.get_num_threads(),
    )  # fmt: skip
    log.info("peer: %s", what)
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
    check_losses(losses["ours"], losses["plain"], STEP_LOSS_RTOL if peer != "plain" else LOSS_RTOL)
    ours_s, plain_s = statistics.median(times["ours"]), statistics.median(times["plain"])
    log.info(
        "median step: ours %.4f s, plain %.4f s, ratio %.3f (%d steps each, %d rounds)",
        ours_s, plain_s, ours_s / plain_s, len(times["ours"]), rounds,
    )  # fmt: skip
    profiled = []
    if profile_steps:  # after the timing: the profiler's own cost is not timed
        profiled = op_differences(ours, plain, range(timed, timed + profile_steps))
        log_differences(profiled, profile_steps)
    return {
        "profile": profiled,  # every op; the log lists the first ROWS
        "ours_step_s": ours_s,
        "plain_step_s": plain_s,
        "ratio": ours_s / plain_s,
        "steps": len(times["ours"]),
        "threads": torch.get_num_threads(),
        "peer": what,
    }
