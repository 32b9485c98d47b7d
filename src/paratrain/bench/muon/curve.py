"""Muon against AdamW in a training run: `paratrain train`'s own step (one process, the
default model and data), the learning-rate schedule and clipping as configured, and the
held-out loss every `every` steps. Recorded, not asserted: which optimizer reaches a loss
first depends on the run, and the bench reports where Muon reaches AdamW's final loss."""

from __future__ import annotations

import copy
from typing import Any

from paratrain.config import RunConfig
from paratrain.data.tokens import BatchSampler, TokenData, validation_batches
from paratrain.mesh import Mesh
from paratrain.train.build import build_engine
from paratrain.train.optim import LrSchedule, muon_settings, peak_lr
from paratrain.train.step import train_step


def held_out_curve(cfg: RunConfig, data: TokenData, every: int) -> list[tuple[int, float]]:
    """(step, held-out loss) after every `every` steps and at the end."""
    t = cfg.train
    engine = build_engine(cfg, mesh=Mesh.build(dp=1))
    muon = muon_settings(cfg)
    optimizer = engine.build_optimizer(peak_lr(cfg), t.weight_decay, (t.beta1, t.beta2), muon=muon)
    schedule = LrSchedule.of(cfg)
    sampler = BatchSampler(data.train, t.seq_len, t.global_batch, t.seed)
    held_out = validation_batches(data.val, t.seq_len, t.micro_batch, t.val_batches)
    curve = []
    for step in range(t.steps):
        batch = sampler.global_batch_at(step)
        train_step(engine, optimizer, list(batch.split(t.micro_batch)), schedule(step), t.grad_clip)
        if (step + 1) % every == 0 or step + 1 == t.steps:
            curve.append((step + 1, engine.evaluate(held_out)))
    return curve


def muon_against_adamw(cfg: RunConfig, data: TokenData, every: int) -> dict[str, Any]:
    """Both curves, and the first step at which Muon's held-out loss is at or below
    AdamW's final one (None: not within the run)."""
    curves = {}
    for name in ("adamw", "muon"):
        run = copy.deepcopy(cfg)
        run.train.optimizer = name
        curves[name] = held_out_curve(run, data, every)
    target = curves["adamw"][-1][1]
    reached = next((step for step, loss in curves["muon"] if loss <= target), None)
    return {"curves": curves, "adamw_final": target, "muon_reaches_it_at": reached}
