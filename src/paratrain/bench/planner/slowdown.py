"""A fixed sleep inside every forward and backward pass of a pipeline's chunks.

The planner's bubble assumes equal stages whose passes cost F = B = W (an unsplit
backward B + W = 2F) and free messages. Our small GPT's passes take a few milliseconds
each, unequal across stages (the last holds the head), and on 2 shared cores the
scheduler's noise is of the same order, so its measured bubble says little about the
schedule. A sleep of one unit per forward and per backward pass (two for an unsplit one)
makes the passes equal and long next to that noise while keeping the CPUs free; the
bubble the runtime's timestamps then show is the schedule's own, which is what the
formula claims. The sleep runs inside the module's call, so the runtime's trace counts
it as compute (busy), as it would a slower kernel.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn


class Slowdown:
    """Sleep `unit_s` in each forward of `modules` and `unit_s * backward_units` when the
    gradient reaches its output (once per pass: twice for ZB-H1's split B and W)."""

    def __init__(self, modules: list[nn.Module], unit_s: float, split_backward: bool) -> None:
        self.unit_s = unit_s
        self.backward_s = unit_s if split_backward else 2 * unit_s
        tables: set[int] = set()
        for m in modules:
            # Pipeline chunks are shallow copies of one model and share its hook tables:
            # register once per table (as record.GraphMeter does).
            if id(m._forward_pre_hooks) in tables:
                continue
            tables.add(id(m._forward_pre_hooks))
            m.register_forward_pre_hook(self._forward)
            m.register_forward_hook(self._arm_backward)

    def _forward(self, _module: nn.Module, _args: Any) -> None:
        if torch.is_grad_enabled():  # training forwards only, not evaluation
            time.sleep(self.unit_s)

    def _arm_backward(self, _module: nn.Module, _args: Any, out: Any) -> None:
        if torch.is_tensor(out) and out.requires_grad:
            out.register_hook(self._backward)

    def _backward(self, grad: torch.Tensor) -> None:
        time.sleep(self.backward_s)
