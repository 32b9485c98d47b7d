"""One optimizer step of data-parallel training over K micro-batches.

Token weighting: each micro-batch contributes the sum of its token losses, and the summed
gradients (over micro-batches and, by the dp all-reduce, over replicas) are divided by the
number of target tokens in the whole global batch. The step therefore equals one step on
all K * b * dp sequences at once even when micro-batches hold different numbers of tokens
(targets equal to IGNORE_INDEX are masked out and do not count).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from paratrain import comm
from paratrain.models.gpt import IGNORE_INDEX
from paratrain.parallel.data_parallel import DataParallel
from paratrain.train.clip import clip_global_norm


@dataclass(frozen=True)
class StepOutput:
    loss: float  # mean token loss over the global batch (all replicas)
    grad_norm: float  # global L2 norm of the reduced gradient, before clipping
    tokens: int  # target tokens in the global batch


def accumulate_gradients(
    model: DataParallel, micro_batches: list[torch.Tensor]
) -> tuple[float, int]:
    """Forward and backward of the micro-batches, one gradient sync, token normalisation.

    Returns (mean token loss over the global batch, target tokens in the global batch);
    afterwards `.grad` holds the gradient of that mean loss on every replica.
    """
    sums = torch.zeros(2, dtype=torch.float64)  # (sum of token losses, tokens) on this rank
    last = len(micro_batches) - 1
    for i, batch in enumerate(micro_batches):
        # Masked (padding) positions are fed token 0; their targets carry the mask.
        inputs, targets = batch[:, :-1].clamp(min=0), batch[:, 1:]
        tokens = int((targets != IGNORE_INDEX).sum())
        if tokens == 0:
            continue  # nothing to learn from; finish_gradient_sync still syncs this step
        # Only the last micro-batch's backward triggers the gradient all-reduce.
        sync = contextlib.nullcontext() if i == last else model.no_sync()
        with sync:
            mean_loss = model(inputs, targets)
            (mean_loss * tokens).backward()
        sums[0] += mean_loss.detach().double() * tokens
        sums[1] += tokens
    model.finish_gradient_sync()
    comm.all_reduce(sums, model.group, op="sum")
    total_tokens = max(1.0, float(sums[1]))
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    torch._foreach_mul_(grads, 1.0 / total_tokens)
    return float(sums[0]) / total_tokens, int(sums[1])


def train_step(
    model: DataParallel,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[torch.Tensor],
    lr: float,
    grad_clip: float,
) -> StepOutput:
    """One whole step on a single-stage replica: accumulate, clip, update."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    model.zero_grad()
    loss, tokens = accumulate_gradients(model, micro_batches)
    grad_norm = clip_global_norm([model.module], grad_clip)  # one process holds all of it
    optimizer.step()
    return StepOutput(loss, grad_norm, tokens)


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, batches: list[torch.Tensor], dp_group: comm.CommGroup
) -> float:
    """Mean token loss over the held-out batches; replica r takes batches r, r + dp, ..."""
    was_training = model.training
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64)  # (loss * tokens, tokens)
    for batch in batches[dp_group.rank :: dp_group.size]:
        tokens = int((batch[:, 1:] != IGNORE_INDEX).sum())
        if tokens:
            sums[0] += model(batch[:, :-1].clamp(min=0), batch[:, 1:]).double() * tokens
            sums[1] += tokens
    comm.all_reduce(sums, dp_group, op="sum")
    model.train(was_training)
    return float(sums[0] / sums[1]) if sums[1] > 0 else float("nan")
