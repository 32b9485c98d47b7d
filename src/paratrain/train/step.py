"""The one training step, used by the CLI's loop, the benchmarks and the equivalence tests.

`train_step(engine, optimizer, micro_batches, lr, grad_clip)` computes the gradients of the
global batch through the engine (any layout: data, tensor, pipeline parallel, ZeRO),
takes the global gradient norm, clips, and updates; a step whose norm is not finite makes
no update on any rank (the norm is global, so every rank decides the same), except under
fp16, where the loss scaler takes the overflow (halves its scale, skips the update).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from paratrain.train.clip import clip_coefficient
from paratrain.train.engine import Engine
from paratrain.train.experts import balance_biases, routing_log

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepOutput:
    loss: float  # mean token loss over the global batch (all replicas)
    grad_norm: float  # global L2 norm of the reduced gradient, before clipping
    tokens: int  # target tokens in the global batch
    skipped: bool = False  # the norm was not finite: no update
    overflow: bool = False  # ... under fp16: the loss scaler's expected skip, not a fault
    routing: dict[str, float] | None = None  # mixture of experts: train/experts.py routing_log


def train_step(
    engine: Engine,
    optimizer: Any,
    micro_batches: list[torch.Tensor],
    lr: float,
    grad_clip: float,
    across: Callable[[Engine, float, int], tuple[float, int]] | None = None,
) -> StepOutput:
    """One whole optimizer step of this rank's part of the model: accumulate, clip, update.

    across: fault tolerance's reduction over the replica groups of the round, between the
    gradient and its use (fault_tolerance/loop.py); it raises when the round is not
    committed, before anything changed."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss, tokens = engine.forward_backward(micro_batches)
    if across is not None:
        loss, tokens = across(engine, loss, tokens)
    grad_norm = engine.grad_norm()
    finite = math.isfinite(grad_norm)
    engine.settle_grads(clip_coefficient(grad_norm, grad_clip) if finite else 1.0)
    if finite or engine.loss_scaled:
        optimizer.step()  # fp16: finds the overflow on every rank, halves the scale, skips
    balance_biases(engine.moe_layers)  # MoE bias balancing after the step (restarts counting)
    overflow = not finite and engine.loss_scaled
    routing = routing_log(engine.moe_layers, engine.replicas[0].group, engine.pp)
    return StepOutput(loss, grad_norm, tokens, not finite, overflow, routing)


class NonFiniteLoss(RuntimeError):
    """Too many consecutive steps had a NaN or infinite gradient norm."""


class SkippedSteps:
    """Counts consecutive steps skipped for a non-finite gradient norm (fp16 overflows are
    the loss scaler's, not faults) and stops the run at the limit."""

    def __init__(self, limit: int) -> None:
        self.limit, self.in_a_row = limit, 0

    def record(self, step: int, out: StepOutput) -> None:
        if out.overflow:
            log.info("step %d: fp16 overflow, the loss scaler skipped it", step + 1)
            return
        if not out.skipped:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        log.warning(
            "step %d skipped: gradient norm %s, loss %s (%d in a row, limit %d)",
            step + 1, out.grad_norm, out.loss, self.in_a_row, self.limit,
        )  # fmt: skip
        if self.in_a_row >= self.limit:
            raise NonFiniteLoss(
                f"{self.in_a_row} consecutive steps (up to step {step + 1}) had a non-finite "
                f"gradient norm; stopping (train.max_skipped_steps = {self.limit}); the last "
                "checkpoint is untouched"
            )
