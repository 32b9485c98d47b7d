"""`paratrain bench overhead`: our training step against a plain PyTorch loop.

Both train their own copy of the same model from the same initial weights on the same
preloaded batches, with the same optimizer flags, clipping, thread count and host syncs
(two `.item()` calls per step). Rounds alternate which loop runs first, and the report
gives the medians of per-step times and their ratio. The two loss curves must agree (they
do the same arithmetic), else the comparison is void and the bench fails.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from paratrain.config import RunConfig
from paratrain.mesh import Mesh
from paratrain.parallel.adamw import adamw
from paratrain.parallel.data_parallel import DataParallel
from paratrain.train.build import build_model
from paratrain.train.data import BatchSampler, load_tokens
from paratrain.train.engine import FlatEngine
from paratrain.train.optim import learning_rate
from paratrain.train.step import train_step

log = logging.getLogger(__name__)
LOSS_RTOL = 1e-5


def plain_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[torch.Tensor],
    lr: float,
    grad_clip: float,
) -> float:
    """The peer: what one would write by hand in plain PyTorch (quoted in the docs)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    total = torch.zeros(())
    for batch in micro_batches:
        loss = model(batch[:, :-1], batch[:, 1:])
        (loss / len(micro_batches)).backward()
        total += loss.detach()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip, foreach=True)
    optimizer.step()
    norm.item()
    return (total / len(micro_batches)).item()


def _timed(fn: Callable[[int], float], steps: range) -> tuple[list[float], list[float]]:
    times, losses = [], []
    for step in steps:
        start = time.perf_counter()
        losses.append(fn(step))
        times.append(time.perf_counter() - start)
    return times, losses


def run_overhead_bench(steps: int = 20, rounds: int = 7) -> dict[str, float]:
    cfg = RunConfig()
    t = cfg.train
    t.microbatches = t.global_batch // t.micro_batch  # one process: K = G / b
    data = load_tokens("")
    sampler = BatchSampler(data.train, t.seq_len, t.global_batch, t.seed)
    total = steps * rounds + 1
    batches = [list(sampler.global_batch_at(s).split(t.micro_batch)) for s in range(total)]
    mesh = Mesh.build(dp=1)  # one process: the dp group has one rank, no communication
    betas = (t.beta1, t.beta2)
    ours = FlatEngine(DataParallel(build_model(cfg), mesh.group("dp"), reduce_op="sum"))
    plain_model = build_model(cfg)
    ours_opt = ours.build_optimizer(t.lr, t.weight_decay, betas)
    plain_opt = adamw(plain_model, t.lr, t.weight_decay, betas)

    def ours(step: int) -> float:
        lr = learning_rate(step, t.lr, t.warmup_steps, total, t.min_lr_ratio)
        out = train_step(ours, ours_opt, batches[step], lr, t.grad_clip)
        return out.loss

    def plain(step: int) -> float:
        lr = learning_rate(step, t.lr, t.warmup_steps, total, t.min_lr_ratio)
        return plain_step(plain_model, plain_opt, batches[step], lr, t.grad_clip)

    log.info(
        "model: GPT %d layers, d_model %d, seq_len %d, %d micro-batches of %d; %d thread(s)",
        cfg.model.n_layer,
        cfg.model.d_model,
        t.seq_len,
        t.microbatches,
        t.micro_batch,
        torch.get_num_threads(),
    )
    log.info("peer: plain PyTorch loop, AdamW(foreach=True), clip_grad_norm_(foreach=True)")
    ours(0), plain(0)  # warm-up step, not timed
    ours_times, plain_times, ours_losses, plain_losses = [], [], [], []
    for r in range(rounds):
        span = range(1 + r * steps, 1 + (r + 1) * steps)
        order = (
            [("ours", ours), ("plain", plain)] if r % 2 == 0 else [("plain", plain), ("ours", ours)]
        )
        for name, fn in order:
            times, losses = _timed(fn, span)
            (ours_times if name == "ours" else plain_times).extend(times)
            (ours_losses if name == "ours" else plain_losses).extend(losses)
    for a, b in zip(ours_losses, plain_losses, strict=True):
        if not math.isclose(a, b, rel_tol=LOSS_RTOL):
            raise RuntimeError(
                f"losses differ ({a} vs {b}): the two loops did not do the same work"
            )
    result = {
        "ours_step_s": statistics.median(ours_times),
        "plain_step_s": statistics.median(plain_times),
        "steps": len(ours_times),
        "threads": torch.get_num_threads(),
    }
    result["ratio"] = result["ours_step_s"] / result["plain_step_s"]
    log.info(
        "median step: ours %.4f s, plain %.4f s, ratio %.3f (%d steps each, %d rounds)",
        result["ours_step_s"],
        result["plain_step_s"],
        result["ratio"],
        len(ours_times),
        rounds,
    )
    return result
