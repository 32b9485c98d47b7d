"""AdamW as paratrain's wrappers build it: decay on matrices and embeddings only, and the
sharded variant that ZeRO-1/2/3 run on this rank's flat shards.

Weight decay is decoupled (AdamW, arXiv:1711.05101) and applies to 2-D and larger
parameters (linear weights, embeddings), not to biases or norm gains.

`ShardedAdamW`: each rank runs torch.optim.AdamW on its fp32 shard(s) (the master copy in
mixed precision, else the parameters themselves), so Adam's m and v exist for 1/k of the
model: ZeRO's P_os (arXiv:1910.02054, section 5.1). A shard mixes decayed and undecayed
parameters, so the decay is applied here to the decayed pieces, p <- p (1 - lr wd), and the
inner AdamW runs with weight_decay 0. torch's AdamW applies the same multiplication first,
before the moment update, so the arithmetic is the same.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from typing import Any

import torch
from torch import nn

from paratrain import comm
from paratrain.comm import compat
from paratrain.parallel.data_parallel.flat_buffer import FlatShard, Piece
from paratrain.parallel.data_parallel.replica import MOMENTS
from paratrain.parallel.data_parallel.whole_module import adam_state
from paratrain.parallel.mixed_precision import DynamicLossScaler, found_inf


def decays(shape: torch.Size | tuple[int, ...]) -> bool:
    """Whether weight decay applies: matrices and embeddings, not biases or norm gains."""
    return len(shape) >= 2


def param_groups(
    model: nn.Module, weight_decay: float, only: Collection[str] | None = None
) -> list[dict[str, Any]]:
    named = model.named_parameters()
    params = [p for n, p in named if p.requires_grad and (only is None or n in only)]
    return [
        {"params": [p for p in params if decays(p.shape)], "weight_decay": weight_decay},
        {"params": [p for p in params if not decays(p.shape)], "weight_decay": 0.0},
    ]


def fastest(params: Iterable[torch.Tensor]) -> dict[str, bool]:
    """torch AdamW's fast path for these parameters: on CUDA the fused kernel (one launch
    for all of them); elsewhere foreach, which batches the many small tensors' updates."""
    params = list(params)
    if params and all(p.is_cuda for p in params):
        return {"fused": True}
    return {"foreach": True}


def adamw(
    model: nn.Module,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float = 1e-8,
    only: Collection[str] | None = None,
) -> torch.optim.AdamW:
    """torch's AdamW over the whole `model` (or its parameters named in `only`), in its
    fastest implementation (`fastest`)."""
    groups = param_groups(model, weight_decay, only)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, **fastest(model.parameters()))


class ShardedAdamW:
    """AdamW over flat shards; `step()` updates them and then calls `after_step`.

    Drives like a torch optimizer: set `param_groups[i]["lr"]`, call `step()`.
    after_step: the wrapper's follow-up, e.g. ZeRO-1/2's all-gather of updated parameters.
    scaler: fp16's loss scaler; a step whose gradients overflowed on any rank is skipped.
    """

    def __init__(
        self,
        shards: list[FlatShard],
        group: comm.CommGroup | None,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        eps: float = 1e-8,
        after_step: Callable[[], None] | None = None,
        scaler: DynamicLossScaler | None = None,
    ) -> None:
        self.shards = shards
        self.group = group
        self.weight_decay = weight_decay
        self.after_step = after_step
        self.scaler = scaler
        params = [s.optimized for s in shards if s.optimized.numel()]
        self.inner = self._inner(params, lr, betas, eps)
        self._decayed = [  # views of the pieces of decayed parameters
            s.optimized[p.shard_offset : p.shard_offset + p.numel]
            for s in shards
            for p in s.layout.local_pieces(s.rank)
            if decays(p.segment.shape)
        ]
        self.steps_skipped = 0

    def _inner(
        self, params: list[torch.Tensor], lr: float, betas: tuple[float, float], eps: float
    ) -> torch.optim.Optimizer:
        """The torch optimizer run on the shards, the decay already applied (sgd.py's
        ShardedSGD runs SGD instead)."""
        return torch.optim.AdamW(
            params, lr=lr, betas=betas, eps=eps, weight_decay=0.0, **fastest(params)
        )

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients belong to the wrapper (`wrapper.zero_grad()`); nothing to do here."""

    @torch.no_grad()
    def step(self) -> None:
        if self.scaler is not None and self.group is not None:
            overflow = found_inf([s.grad for s in self.shards], self.group)
            self.scaler.update(overflow)
            if overflow:  # nothing changed anywhere: no gather is needed either
                self.steps_skipped += 1
                return
        for s in self.shards:
            opt = s.optimized
            s.optimized.grad = s.grad if s.grad.dtype == opt.dtype else s.grad.to(opt.dtype)
        lr = self.inner.param_groups[0]["lr"]
        if self.weight_decay and self._decayed:
            compat.foreach_mul_(self._decayed, 1.0 - lr * self.weight_decay)
        self.inner.step()
        for s in self.shards:
            s.optimized.grad = None
            if s.master is not None:
                s.param.copy_(s.master)  # the 16-bit compute copy follows the master
        if self.after_step is not None:
            self.after_step()

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    @property
    def states(self) -> list[dict[str, Any]]:
        """Every state dict this optimizer holds (the memory report counts them)."""
        return list(self.inner.state.values())

    def piece_moments(self, si: int, piece: Piece) -> dict[str, torch.Tensor]:
        """AdamW's moments of one piece of shard `si` (views of live storage)."""
        state = adam_state(self.inner, self.shards[si].optimized)
        at = slice(piece.shard_offset, piece.shard_offset + piece.numel)
        return {key: state[key][at] for key in MOMENTS}

    def moment_keys(self, name: str) -> tuple[str, ...]:
        return MOMENTS

    def step_counters(self) -> list[torch.Tensor]:
        return [
            adam_state(self.inner, s.optimized)["step"] for s in self.shards if s.optimized.numel()
        ]
