"""Keys and values of the positions decoded so far, so that incremental decoding computes
each new token's attention against them instead of re-running the whole prefix.

Plain PyTorch, shared by the GPT and the Llama: attention calls `layer.extend(k, v)` with
the new positions' keys and values (B, heads, T_new, hd) and gets everything cached so
far, itself included; `length` is how many positions came before the new ones (where
positions and rotary angles continue).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class LayerCache:
    def __init__(self) -> None:
        self.k: torch.Tensor | None = None  # (B, kv_heads, T_cached, hd)
        self.v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v


class KVCache:
    """One LayerCache per block, in block order."""

    def __init__(self, n_layer: int) -> None:
        self.layers = [LayerCache() for _ in range(n_layer)]

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    past: int,
    dropout_p: float = 0.0,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of T new queries (after `past` cached positions) over all keys.

    Without a past it is the usual causal mask; a single new query sees every key; several
    new queries after a past (a prompt fed in pieces) see the past and their own prefix.
    With `positions` (B, T), each token's position within its packed document, a token
    sees only its own document's tokens up to itself (token_rows.document_positions).
    """
    new = q.shape[2]
    if positions is not None:
        assert past == 0, "packed documents are trained, not decoded"
        mask = document_mask(positions).unsqueeze(1)  # (B, 1, T, T), over the heads
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
    if past == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)
    if new == 1:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
    rows = torch.arange(new, device=q.device).unsqueeze(1)  # (T_new, 1)
    cols = torch.arange(past + new, device=q.device).unsqueeze(0)  # (1, T_all)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=cols <= rows + past, dropout_p=dropout_p
    )


def document_mask(positions: torch.Tensor) -> torch.Tensor:
    """(B, T) positions within packed documents -> (B, T, T) bool: query i sees key j when
    j <= i and j is no further back than i's document start (i - positions[i])."""
    index = torch.arange(positions.shape[-1], device=positions.device)
    back = index.unsqueeze(-1) - index  # (T, T): i - j
    return (back >= 0) & (back <= positions.unsqueeze(-1))
