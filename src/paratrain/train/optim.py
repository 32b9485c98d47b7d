"""The learning-rate schedule, Muon's settings, and the replicas' optimizers driven as one.

The optimizers themselves (AdamW, decay on matrices and embeddings; the sharded AdamW of
ZeRO; Muon with AdamW) are built by each data-parallel wrapper: parallel/data_parallel/
adamw.py and muon.py.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from paratrain.config import LR_SCALINGS, RunConfig
from paratrain.config.resolution import muon_ns_dtype
from paratrain.models.plans import PLANS
from paratrain.parallel.data_parallel.muon_math import MuonSettings

log = logging.getLogger(__name__)


def learning_rate(step: int, base_lr: float, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup from 0 over `warmup` steps, then cosine decay to min_ratio * base_lr.

    `step` counts from 0; the first step uses base_lr / warmup (not 0), so no step is wasted.
    """
    if warmup and step < warmup:
        return base_lr * (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return base_lr * (min_ratio + (1.0 - min_ratio) * cosine)


def warmup_note(cfg: RunConfig) -> str | None:
    """A line saying so when the run ends inside its warm-up: its rate never reaches the peak."""
    t = cfg.train
    if t.steps >= t.warmup_steps:
        return None
    peak = peak_lr(cfg)
    last = learning_rate(t.steps - 1, peak, t.warmup_steps, t.steps, t.min_lr_ratio)
    return (
        f"note: --steps {t.steps} ends inside the --warmup-steps {t.warmup_steps} warm-up: "
        f"the learning rate rises to {last:.3g}, never to its peak {peak:.3g}"
    )


def scaled_lr(base_lr: float, global_batch: int, base_batch: int, scaling: str) -> float:
    """The peak rate for a global batch, from a rate tuned at `base_batch` (seeds, 9.2.1).

    linear: lr * G / G0 (Goyal et al. 2017, arXiv:1706.02677), for SGD-like optimizers;
    sqrt: lr * sqrt(G / G0), which keeps the update's noise scale (Krizhevsky 2014,
    arXiv:1404.5997; Malladi et al. 2022 for Adam); none: lr unchanged.
    """
    ratio = global_batch / base_batch
    if scaling == "linear":
        return base_lr * ratio
    if scaling == "sqrt":
        return base_lr * math.sqrt(ratio)
    if scaling == "none":
        return base_lr
    raise ValueError(f"lr scaling {scaling!r}; valid: {', '.join(LR_SCALINGS)}")


@dataclass(frozen=True)
class Rewarmup:
    """A short linear ramp of the learning rate after resuming on another world size."""

    start: int = 0  # the first step after the resume
    steps: int = 0

    def factor(self, step: int) -> float:
        if self.steps <= 0 or step >= self.start + self.steps:
            return 1.0
        return (step - self.start + 1) / self.steps


@dataclass(frozen=True)
class LrSchedule:
    """The learning rate of each step: warmup, cosine decay, and a re-warmup if resumed."""

    peak: float
    warmup: int
    total: int
    min_ratio: float
    rewarm: Rewarmup = Rewarmup()

    @classmethod
    def of(cls, cfg: RunConfig, rewarm: Rewarmup = Rewarmup()) -> LrSchedule:
        t, peak = cfg.train, peak_lr(cfg)
        if t.lr_scaling != "none":
            log.info(
                "learning rate %.3g at batch %d, %s scaling to batch %d: %.3g",
                t.lr, t.lr_base_batch, t.lr_scaling, t.global_batch, peak,
            )  # fmt: skip
        return cls(peak, t.warmup_steps, t.steps, t.min_lr_ratio, rewarm)

    def __call__(self, step: int) -> float:
        lr = learning_rate(step, self.peak, self.warmup, self.total, self.min_ratio)
        return lr * self.rewarm.factor(step)


def muon_settings(cfg: RunConfig) -> MuonSettings | None:
    """Muon's settings under `--optimizer muon` (its matrices from the model plan), else
    None: AdamW for everything."""
    t = cfg.train
    if t.optimizer != "muon":
        return None
    return MuonSettings(
        matrices=PLANS[cfg.model.arch].muon_matrices,
        momentum=t.muon_momentum,
        nesterov=t.muon_nesterov,
        ns_steps=t.muon_ns_steps,
        lr_adjust=t.muon_lr_adjust,
        ns_dtype=getattr(torch, muon_ns_dtype(t.muon_ns_dtype, cfg.parallel.device)),
    )


def peak_lr(cfg: RunConfig) -> float:
    t = cfg.train
    return scaled_lr(t.lr, t.global_batch, t.lr_base_batch, t.lr_scaling)


class OptimizerSet:
    """The optimizers of several replicas (one per pipeline chunk) driven as one: the
    learning rate is set on every param group, `step()` steps them all."""

    def __init__(self, optimizers: list[Any]) -> None:
        self.optimizers = optimizers
        # DiLoCo's outer optimizer (parallel/diloco.py `OuterStep`; train/diloco.py sets
        # it), checkpointed with the rest; None in every other mode
        self.outer: Any = None

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.optimizers for g in o.param_groups]

    def step(self) -> None:
        for o in self.optimizers:
            o.step()
