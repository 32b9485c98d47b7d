"""Plain SGD (--optimizer sgd) as paratrain's wrappers build it: p <- p - lr (g + wd p),
weight decay on matrices and embeddings only (adamw.py `decays`), no momentum, so no
optimizer state at all: what DiLoCo's equality with data parallelism needs (one SGD step
of each group averaged is one SGD step on the averaged gradient, docs/diloco.md).

`PlainSGD`: torch's SGD over a whole module. `ShardedSGD`: over ZeRO's flat shards, as
ShardedAdamW runs AdamW there: the decay applied to the decayed pieces first,
p <- p (1 - lr wd), then p <- p - lr g, the same update up to rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import nn

from paratrain import comm
from paratrain.parallel.data_parallel.adamw import ShardedAdamW, param_groups
from paratrain.parallel.data_parallel.flat_buffer import FlatShard, Piece
from paratrain.parallel.mixed_precision import DynamicLossScaler


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
    """Plain SGD over flat shards; `step()` updates them and then calls `after_step`."""

    def __init__(
        self,
        shards: list[FlatShard],
        group: comm.CommGroup | None,
        lr: float,
        weight_decay: float,
        after_step: Callable[[], None] | None = None,
        scaler: DynamicLossScaler | None = None,
    ) -> None:
        super().__init__(shards, group, lr, weight_decay, (0.9, 0.999), 1e-8, after_step, scaler)
        params = [s.optimized for s in shards if s.optimized.numel()]
        self.inner = torch.optim.SGD(params, lr=lr, momentum=0.0, foreach=True)  # type: ignore[assignment]

    def piece_moments(self, si: int, piece: Piece) -> dict[str, torch.Tensor]:
        return {}

    def moment_keys(self, name: str) -> tuple[str, ...]:
        return ()

    def step_counters(self) -> list[torch.Tensor]:
        return []

    @property
    def states(self) -> list[dict[str, Any]]:
        return []
