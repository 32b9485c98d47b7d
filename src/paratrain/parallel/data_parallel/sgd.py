"""Plain SGD (--optimizer sgd) as paratrain's wrappers build it: p <- p - lr (g + wd p),
weight decay on matrices and embeddings only (adamw.py `decays`), no momentum, so no
optimizer state at all: what DiLoCo's equality with data parallelism needs (one SGD step
of each group averaged is one SGD step on the averaged gradient, docs/diloco.md).

`PlainSGD`: torch's SGD over a whole module. `ShardedSGD`: over ZeRO's flat shards, as
ShardedAdamW runs AdamW there: the decay applied to the decayed pieces first,
p <- p (1 - lr wd), then p <- p - lr g, the same update up to rounding.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from torch import nn

from paratrain.parallel.data_parallel.adamw import ShardedAdamW, param_groups
from paratrain.parallel.data_parallel.flat_buffer import Piece


class PlainSGD(torch.optim.SGD):
    """torch's SGD without momentum: no state for a checkpoint to hold."""

    def moment_keys(self, name: str) -> tuple[str, ...]:
        return ()


def sgd(
    model: nn.Module, lr: float, weight_decay: float, only: Collection[str] | None = None
) -> PlainSGD:
    """Plain SGD over the whole `model` (or its parameters named in `only`)."""
    return PlainSGD(param_groups(model, weight_decay, only), lr=lr, momentum=0.0, foreach=True)


class ShardedSGD(ShardedAdamW):
    """Plain SGD over flat shards; `step()` updates them and then calls `after_step`.
    Built as ShardedAdamW is (its betas and eps unused)."""

    def _inner(
        self, params: list[torch.Tensor], lr: float, betas: tuple[float, float], eps: float
    ) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=lr, momentum=0.0, foreach=True)

    def piece_moments(self, si: int, piece: Piece) -> dict[str, torch.Tensor]:
        return {}

    def moment_keys(self, name: str) -> tuple[str, ...]:
        return ()

    def step_counters(self) -> list[torch.Tensor]:
        return []

    @property
    def states(self) -> list[dict[str, Any]]:
        return []
