"""The two pieces of a model that depend on where its tokens sit in the sequence: the core
attention (the scaled-dot-product call) and the tokens' positions.

Both are parameterless modules, so that a strategy can swap them from outside without
touching the model's code or its state dict: context parallelism replaces the core with
ring or all-to-all attention over its group, and the positions with those of this rank's
chunks of the sequence (parallel/context_parallel/apply.py; models/plans.py names them).
Plain, they are what a single device computes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paratrain.models.kv_cache import attend


class CoreAttention(nn.Module):
    """softmax(q kᵀ/sqrt(d) + causal mask) v for T new queries after `past` cached positions,
    or with `positions` (B, T) of packed documents, each query over its document's prefix.

    q (B, h, T, d); k and v (B, h_kv, T_all, d) with h_kv dividing h: query head i reads
    key/value head i // (h / h_kv) (grouped-query attention), expanded here so that a
    replacement can move the h_kv heads instead of h.
    """

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        past: int = 0,
        dropout_p: float = 0.0,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        group = q.shape[1] // k.shape[1]
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return attend(q, k, v, past, dropout_p, positions)  # (B, h, T, d)


class Positions(nn.Module):
    """The global positions of the `length` tokens a forward sees, after `past` cached ones."""

    def forward(self, length: int, past: int, device: torch.device) -> torch.Tensor:
        return torch.arange(past, past + length, device=device)  # (T,)


def extra_arguments(cache: Any, positions: torch.Tensor | None) -> tuple[Any, ...]:
    """A block's or attention's arguments after x: none in plain training, where wrappers
    that see the attention's input (DTensor's PrepareModuleInput) expect the one tensor;
    the layer's cache when decoding; packed documents' positions."""
    if positions is not None:
        return (None, positions)
    return () if cache is None else (cache,)
