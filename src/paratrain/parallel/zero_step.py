"""One optimizer step driven through a sharded wrapper: the exact calls a loop must make.

The same token weighting as train/step.py (each micro-batch contributes the sum of its
token losses; gradients are divided by the global target-token count), with the three
differences that sharding brings:

1. scaling and clipping go through the wrapper (`scale_grads_`, `clip_grad_norm_`): the
   reduced gradient exists only as this rank's shard, so `p.grad` cannot be used;
2. `optimizer.step()` is the wrapper's ShardedAdamW (it also all-gathers for ZeRO-1/2);
3. no micro-batch is skipped, even one with no target tokens: ZeRO-3 gathers parameters
   in every forward and ZeRO-2 (accumulate="shard") and ZeRO-3 reduce-scatter after every
   backward, so every rank must run the same number of passes or the collectives
   mismatch. An all-masked micro-batch runs with its loss multiplied by 0 (its targets
   clamped to a valid id, so the zero gradient is exact rather than 0 * nan).
"""

from __future__ import annotations

import contextlib
from typing import Protocol

import torch

from paratrain import comm
from paratrain.train.step import accumulate_gradients  # the loop's own accumulation


class ShardedWrapper(Protocol):
    """What ZeroDataParallel and FullyShardedDataParallel both offer."""

    group: comm.CommGroup

    def __call__(self, *args: object) -> torch.Tensor: ...
    def no_sync(self) -> contextlib.AbstractContextManager: ...
    def finish_gradient_sync(self) -> None: ...
    def zero_grad(self, set_to_none: bool = False) -> None: ...
    def scale_grads_(self, factor: float) -> None: ...
    def clip_grad_norm_(self, max_norm: float) -> float: ...


def sharded_train_step(
    model: ShardedWrapper,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[torch.Tensor],
    lr: float,
    grad_clip: float,
) -> tuple[float, float, int]:
    """Accumulate, normalise, clip, update. Returns (mean token loss, grad norm, tokens)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    model.zero_grad()
    loss, tokens = accumulate_gradients(model, micro_batches)
    model.scale_grads_(1.0 / max(tokens, 1))
    grad_norm = model.clip_grad_norm_(grad_clip)
    optimizer.step()
    return loss, grad_norm, tokens
