"""Loss terms computed on a stage that does not hold the loss, carried by its output.

A mixture of experts adds each block's load-balancing loss to the objective, and a block's
router runs on whatever stage holds the block. The last stage's own terms join its loss
(the model's forward adds them); a middle stage's would reach no backward. So the runtime
ties them to the stage's output: `attach(y, term)` is y in the forward, and in the backward
passes y its gradient unchanged and gives `term` the gradient 1, as if the stage's
backward were that of y·dy + term. One root per stage stays one root, so every schedule's
backward (ZB-H1's split one too, split_backward.py) handles it as it handles y.
Megatron-Core ties its MoE auxiliary loss to the activations the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

# What a chunk adds to the objective after its training forward; None when nothing.
StageLoss = Callable[[nn.Module], torch.Tensor | None]


class _Attach(torch.autograd.Function):
    apply: ClassVar[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]  # (torch: untyped)

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, term: torch.Tensor) -> torch.Tensor:
        ctx.term_dtype = term.dtype
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, grad.new_ones((), dtype=ctx.term_dtype)


def attach(y: torch.Tensor, term: torch.Tensor) -> torch.Tensor:
    """y, whose backward also backpropagates the scalar `term` with gradient 1."""
    return _Attach.apply(y, term)
