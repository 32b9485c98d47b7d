"""The peer of `paratrain bench pp`: `torch.distributed.pipelining` on the same GPT split.

`PipelineStage` per chunk and the schedule class in PEER, with a mean cross-entropy
`loss_fn` and `scale_grads=True` (gradients divided by K), which is the arithmetic of our
runtime (each micro-batch's mean loss / K). `return_outputs=False`, since ours does not
gather the logits either. After the schedule, the global gradient norm over the stages
(each stage's squared norm summed across them, as torchtitan does) clips the gradients
before AdamW steps, as ours does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratrain.bench.harness.sides import clip_grad_norm

# Ours -> (torch.distributed.pipelining schedule class, chunks per stage on both sides).
# torch's ScheduleInterleavedZeroBubble with one stage per rank is its ZB1P schedule
# without interleaving, the counterpart of our ZB-H1 (arXiv:2401.10241, 3.1).
PEER = {
    "gpipe": ("ScheduleGPipe", 1),
    "1f1b": ("Schedule1F1B", 1),
    "interleaved": ("ScheduleInterleaved1F1B", 2),
    "zb-h1": ("ScheduleInterleavedZeroBubble", 1),
}
SINGLE_STAGE = ("ScheduleGPipe", "Schedule1F1B")  # take one stage, the others a list


class _PeerChunk(nn.Module):
    """A chunk as torch's stage calls it: one positional input, logits out on the last.

    Our chunks compute the loss themselves when given targets; torch's schedule applies
    `loss_fn` to the last stage's output instead, so the wrapper never passes targets.
    """

    def __init__(self, chunk: nn.Module) -> None:
        super().__init__()
        self.chunk = chunk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.chunk(x)  # (b, T, C) hidden states, or (b, T, V) logits on the last


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())  # (bT, V)


def build_peer(chunks: list[nn.Module], rank: int, world: int, name: str, k: int) -> Any:
    """torch's schedule over this rank's chunks (same stage indices as ours)."""
    from torch.distributed import pipelining

    cls_name, v = PEER[name]
    stages = [
        pipelining.PipelineStage(_PeerChunk(c), i * world + rank, world * v, torch.device("cpu"))
        for i, c in enumerate(chunks)
    ]
    cls = getattr(pipelining, cls_name)
    first = stages[0] if cls_name in SINGLE_STAGE else stages
    return cls(first, k, loss_fn=_cross_entropy, scale_grads=True)


def peer_step(
    schedule: Any,
    optimizer: torch.optim.Optimizer,
    batch: torch.Tensor,
    lr: float,
    grad_clip: float,
    *,
    params: Sequence[torch.Tensor],
    rank: int,
    world: int,
) -> float:
    """One step of this rank's stages; the loss (mean over micro-batches) on the last rank,
    NaN elsewhere."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    losses: list[torch.Tensor] = []
    if rank == 0:
        schedule.step(batch[:, :-1], return_outputs=False)  # first stage: token ids
    elif rank == world - 1:
        schedule.step(target=batch[:, 1:], losses=losses, return_outputs=False)
    else:
        schedule.step(return_outputs=False)
    norm = clip_grad_norm(params, grad_clip, stages=dist.group.WORLD)
    optimizer.step()
    norm.item()
    # The loss lives on the last stage; the parent reads it from the last rank.
    return float(torch.stack(losses).detach().mean()) if losses else math.nan
