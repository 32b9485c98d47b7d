"""The two sides of a comparison: our one training step, and the peer's as one writes it in
plain PyTorch, doing the same work.

Ours (`OurSide`) is the engine the CLI builds for the configuration (`build_engine`) and
`train_step`: accumulate, reduce over dp, the global gradient norm, clip, update. Its loss
is the global batch's mean (an all-reduce of (loss x tokens, tokens) over dp inside the
step); a peer's is its own rank's, so benches compare ours with the mean of the peer's
per-rank losses (every rank holds as many target tokens) instead of adding a collective
to the peer.

The peer (`torch_step`) sets the learning rate, zeroes its gradients, runs forward and
backward, takes the global gradient norm and clips by it with torch's own functions
(`clip_grad_norm`), steps AdamW, and reads the norm and the loss on the host, as ours does.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from paratrain.config import RunConfig
from paratrain.train.engine import Engine
from paratrain.train.optim import muon_settings
from paratrain.train.step import train_step


def norm_only(cfg: RunConfig) -> RunConfig:
    """`cfg` for a two-sided comparison: both sides take the global gradient norm (and pay
    for it), neither clips by it.

    Ours sums squared norms in float64, torch's clip_grad_norm_ in float32: norms equal to
    the last bits scale the gradients by coefficients equal to the last bits, and AdamW,
    dividing by sqrt(v), grows that step by step (measured, bench dp with clipping at 1.0:
    the losses 2.2e-4 apart at step 20). That drift would hide a real difference between
    the steps, which the loss check is there to catch; without clipping the two sides do
    the same arithmetic (bit-equal in bench dp) and the check keeps its 1e-4 bound.
    `bench overhead`, one process on each side, clips as training does.
    """
    cfg = copy.deepcopy(cfg)
    cfg.train.grad_clip = 0.0
    return cfg


class OurSide:
    """`train_step` on `engine` at the configuration's constant learning rate and clip."""

    def __init__(self, engine: Engine, cfg: RunConfig) -> None:
        t = cfg.train
        self.engine = engine
        betas, muon = (t.beta1, t.beta2), muon_settings(cfg)  # AdamW, or --optimizer muon's
        self.optimizer = engine.build_optimizer(t.lr, t.weight_decay, betas, muon=muon)
        self.lr, self.grad_clip = t.lr, t.grad_clip

    def __call__(self, micro_batches: list[torch.Tensor]) -> float:
        return train_step(self.engine, self.optimizer, micro_batches, self.lr, self.grad_clip).loss


def rank_share(global_batches: list[torch.Tensor], rank: int, world: int) -> list[torch.Tensor]:
    """This rank's 1/world of each global batch, as data parallelism splits it."""
    per_rank = global_batches[0].shape[0] // world
    return [b[rank * per_rank : (rank + 1) * per_rank] for b in global_batches]


def torch_step(
    model: nn.Module,
    optimizer: Any,
    micro_batches: list[torch.Tensor],
    lr: float,
    grad_clip: float,
    *,
    forward: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
    norm_scope: AbstractContextManager[Any] | None = None,
) -> float:
    """One step of a peer `model` (DDP, FSDP2, DTensor, a plain module) on this rank's
    micro-batches; returns this rank's mean loss.

    forward: a context around forward and backward (DTensor's loss_parallel);
    norm_scope: a context around the norm and the clip only (to count their traffic).
    """
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    losses = []
    for batch in micro_batches:
        with forward():
            loss = model(batch[:, :-1], batch[:, 1:])
            (loss / len(micro_batches)).backward()
        losses.append(_local(loss.detach()))
    with norm_scope or contextlib.nullcontext():
        norm = clip_grad_norm(model.parameters(), grad_clip)
    optimizer.step()
    norm.item()
    return (torch.stack(losses).sum() / len(micro_batches)).item()


def clip_grad_norm(
    parameters: Iterable[torch.Tensor], max_norm: float, stages: Any = None
) -> torch.Tensor:
    """The peers' global gradient norm, clipped by: `torch.nn.utils.clip_grad_norm_(...,
    foreach=True)` for plain gradients. Split gradients need two more steps, as in
    torchtitan: a DTensor's norm is made whole (`full_tensor`, which all-reduces), and
    with pipeline `stages` (a torch process group) the squared norms are summed across
    them. A foreach kernel takes one kind of tensor, so DTensor and plain gradients are
    normed apart and combined. max_norm <= 0: the norm alone, no clipping (as ours)."""
    from torch.distributed.tensor import DTensor

    params = [p for p in parameters if p.grad is not None]
    dtensors = [p for p in params if isinstance(p, DTensor)]
    plain = [p for p in params if not isinstance(p, DTensor)]
    kinds = [k for k in (dtensors, plain) if k]
    if not kinds:
        return torch.zeros(())
    if len(kinds) == 1 and stages is None and max_norm > 0:
        return _whole(torch.nn.utils.clip_grad_norm_(kinds[0], max_norm, foreach=True))
    grads = [[p.grad for p in k if p.grad is not None] for k in kinds]  # every one has one
    norms = [torch.nn.utils.get_total_norm(g, foreach=True) for g in grads]
    squares = torch.stack([_whole(n) for n in norms]).square().sum()
    if stages is not None:  # the peer is plain PyTorch: its collectives are torch's own,
        import torch.distributed as dist  # not paratrain.comm's (not in our ledger)

        dist.all_reduce(squares, group=stages)
    norm = squares.sqrt()
    if max_norm > 0:
        for k in kinds:
            torch.nn.utils.clip_grads_with_norm_(k, max_norm, norm, foreach=True)
    return norm


def full_parameters(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of a peer's module whole on every rank, DTensor shards gathered
    (collective: the same order on all ranks)."""
    return {n: _whole(p).detach().clone() for n, p in module.named_parameters()}


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (collective for a partial one); a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _local(t: torch.Tensor) -> torch.Tensor:
    """A loss as a plain tensor: a replicated DTensor's local copy is its whole value."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t
