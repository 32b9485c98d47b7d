"""Attention over one block of keys, with its log-sum-exp, and the gradients of that block
given the whole row's log-sum-exp: the arithmetic ring attention is built from.

Written with matmul and logsumexp rather than torch's scaled_dot_product_attention: on the
CPU the public SDPA returns no log-sum-exp, which merging blocks needs, and the private
flash kernel that does is not part of the API; explicit math also runs in float64, where
the tests compare with full attention to 1e-12, and its matmuls are what
FlopCounterMode counts. The price is the (queries, keys) score block in memory per step,
which a GPU version would avoid with a kernel that returns the log-sum-exp.

The merge rule (Milakov & Gimelshein, arXiv:1805.02867; FlashAttention, arXiv:2205.14135):
for two disjoint sets of keys with partial outputs o1, o2 and log-sum-exps l1, l2 of the
same query row, l = log(e^l1 + e^l2) and o = o1·e^(l1-l) + o2·e^(l2-l). The backward is
FlashAttention-2's (arXiv:2307.08691, algorithm 2): with the row's final l and
D = rowsum(dO ∘ O), each block's P = exp(S - l) gives dV = Pᵀ dO, dS = P ∘ (dO Vᵀ - D),
dQ = dS K·scale, dK = dSᵀ Q·scale, so blocks can be differentiated one at a time.
"""

from __future__ import annotations

import torch


def expand_heads(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """(b, kv_heads, n, d) -> (b, heads, n, d): query head i reads key/value head i // group
    (grouped-query attention, as the Llama model does it)."""
    group = heads // kv.shape[1]
    return kv if group == 1 else kv.repeat_interleave(group, dim=1)


def fold_heads(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(b, heads, n, d) -> (b, kv_heads, n, d): the gradient of `expand_heads`, summed over
    the query heads that shared a key/value head."""
    b, heads, n, d = grad.shape
    if heads == kv_heads:
        return grad
    return grad.view(b, kv_heads, heads // kv_heads, n, d).sum(2)


def _scores(
    q: torch.Tensor, k: torch.Tensor, scale: float, mask: torch.Tensor | None
) -> torch.Tensor:
    scores = (q @ k.transpose(-2, -1)) * scale  # (b, h, m, n)
    return scores if mask is None else scores.masked_fill(~mask, float("-inf"))


def attend_block(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q (b, h, m, d) over this block's keys only: (out, lse (b, h, m)).

    Every query row must see at least one key of the block (callers skip blocks it does
    not see at all), else its lse is -inf and its output NaN.
    """
    scores = _scores(q, k, scale, mask)
    lse = torch.logsumexp(scores, dim=-1)  # (b, h, m)
    return torch.exp(scores - lse.unsqueeze(-1)) @ v, lse


def merge(
    out: torch.Tensor | None,
    lse: torch.Tensor | None,
    block_out: torch.Tensor,
    block_lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine a running (out, lse) with one more block's by the log-sum-exp rule."""
    if out is None or lse is None:
        return block_out, block_lse
    new = torch.logaddexp(lse, block_lse)  # (b, h, m)
    merged = out * torch.exp(lse - new).unsqueeze(-1)
    return merged + block_out * torch.exp(block_lse - new).unsqueeze(-1), new


def attend_block_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None,
    lse: torch.Tensor,
    delta: torch.Tensor,
    dout: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of this block's share of the attention, from the row's final `lse` and
    `delta` = rowsum(dout * out) (b, h, m); k and v already expanded to q's heads."""
    p = torch.exp(_scores(q, k, scale, mask) - lse.unsqueeze(-1))  # the row's probabilities
    dv = p.transpose(-2, -1) @ dout  # (b, h, n, d)
    ds = p * (dout @ v.transpose(-2, -1) - delta.unsqueeze(-1))  # (b, h, m, n)
    return (ds @ k) * scale, (ds.transpose(-2, -1) @ q) * scale, dv
