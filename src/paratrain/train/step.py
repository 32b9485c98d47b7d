"""One optimizer step of data-parallel training over K micro-batches."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from paratrain import comm
from paratrain.parallel import data_parallel


@dataclass(frozen=True)
class StepOutput:
    loss: float  # mean token loss over the global batch (all replicas)
    grad_norm: float  # global L2 norm of the averaged gradient, before clipping


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[torch.Tensor],
    dp_group: comm.CommGroup,
    lr: float,
    grad_clip: float,
) -> StepOutput:
    """Accumulate gradients over the micro-batches, average over dp, clip, update.

    Each micro-batch row is seq_len + 1 token ids; all rows are full length, so every
    micro-batch holds the same number of tokens and 1/K per micro-batch weights each token
    equally: the step equals one step on all K * b * dp sequences at once.
    """
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    num_micro = len(micro_batches)
    total = torch.zeros(())
    for batch in micro_batches:
        loss = model(batch[:, :-1], batch[:, 1:])
        (loss / num_micro).backward()
        total += loss.detach()
    # Looked up on the module so that a test can swap in a deliberately broken reduction.
    data_parallel.all_reduce_gradients(model, dp_group)
    params = [p for p in model.parameters() if p.grad is not None]
    max_norm = grad_clip if grad_clip > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
    optimizer.step()
    mean_loss = comm.all_reduce(total / num_micro, dp_group, op="avg")
    return StepOutput(loss=mean_loss.item(), grad_norm=grad_norm.item())


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[torch.Tensor], dp_group: comm.CommGroup) -> float:
    """Mean loss over the held-out batches; replica r takes batches r, r + dp, ..."""
    was_training = model.training
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64)  # (loss * tokens, tokens)
    for batch in batches[dp_group.rank :: dp_group.size]:
        tokens = batch[:, 1:].numel()
        sums[0] += model(batch[:, :-1], batch[:, 1:]).double() * tokens
        sums[1] += tokens
    comm.all_reduce(sums, dp_group, op="sum")
    model.train(was_training)
    return float(sums[0] / sums[1]) if sums[1] > 0 else float("nan")
