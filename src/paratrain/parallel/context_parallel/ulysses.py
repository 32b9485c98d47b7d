"""All-to-all attention (DeepSpeed-Ulysses, Jacobs et al., arXiv:2309.14509).

Attention mixes tokens but not heads, so instead of moving keys around the sequence it
moves heads: one all-to-all turns the sequence-sharded q, k, v (b, h, s/cp, d) into
head-sharded ones (b, h/cp, s, d), each rank computes ordinary attention over the whole
sequence for its heads, and one all-to-all turns the output back (b, h, s/cp, d). Every
rank does the same work whatever the mask, so the layout needs no balancing; the tokens
arrive in the layout's order (rank 0's, then rank 1's), which is what the causal mask is
built from, so it works with the plain and the load-balanced layout alike.

The attention in between is torch's scaled_dot_product_attention, which keeps no s x s
scores for backward (its kernels recompute them): causal in the plain layout, where rank
order is sequence order, and a boolean mask of the positions in the load-balanced one.
Until 2026-12-07 it was written out (scores, logsumexp, softmax times v) under autograd,
which kept two (b, h/cp, s, s) float32 tensors a layer: llama-tiny over cp 2 measured 35%
more activations than the planner's count for fused attention (`paratrain simulate`).

q, k and v go in one fused all-to-all rather than three: one message per peer instead of
three (a third of the latency terms), and the concatenation costs nothing extra, since
rearranging each tensor into per-destination chunks copies it anyway. The backward of an
all-to-all with equal chunks is the same all-to-all of the gradient (rank r's chunk p came
from rank p's chunk r), so each direction's gradient is again one call.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from paratrain import comm
from paratrain.comm.group import CommGroup
from paratrain.parallel.context_parallel.blocks import expand_heads
from paratrain.parallel.context_parallel.layout import permutation


class _AllToAll(torch.autograd.Function):
    """Equal-chunk all-to-all along dimension 0, forward and backward."""

    apply: ClassVar[Callable[[torch.Tensor, CommGroup], torch.Tensor]]  # (torch: untyped)

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: CommGroup) -> torch.Tensor:
        ctx.group = group
        return comm.all_to_all(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return comm.all_to_all(grad.contiguous(), ctx.group), None


def _to_heads(tensors: list[torch.Tensor], group: CommGroup) -> list[torch.Tensor]:
    """(b, h_i, n, d) sequence-sharded -> (b, h_i/cp, cp·n, d) head-sharded, in one call."""
    cp = group.size
    chunks = []
    for t in tensors:
        b, h, n, d = t.shape
        # (b, cp, h/cp, n, d) -> (cp, ...): chunk j holds head group j, for rank j
        chunks.append(t.reshape(b, cp, h // cp, n, d).transpose(0, 1).reshape(cp, -1))
    arrived = _AllToAll.apply(torch.cat(chunks, dim=1), group)  # (cp: source rank, sum)
    out, start = [], 0
    for t in tensors:
        b, h, n, d = t.shape
        width = t.numel() // cp
        part = arrived.narrow(1, start, width).reshape(cp, b, h // cp, n, d)
        # source rank i sent its n tokens: concatenated in rank order along the sequence
        out.append(part.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * n, d))
        start += width
    return out


def _to_sequence(y: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """(b, h/cp, cp·n, d) head-sharded -> (b, h, n, d) sequence-sharded, in one call."""
    cp = group.size
    b, local_heads, s, d = y.shape
    n = s // cp
    # chunk j of the sequence goes to rank j: (cp, b, h/cp, n, d)
    send = y.reshape(b, local_heads, cp, n, d).permute(2, 0, 1, 3, 4).reshape(cp, -1)
    arrived = _AllToAll.apply(send, group).reshape(cp, b, local_heads, n, d)  # source: heads
    return arrived.transpose(0, 1).reshape(b, cp * local_heads, n, d)


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: CommGroup,
    causal: bool = True,
    balanced: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of this rank's tokens over the whole sequence, by two all-to-alls.

    q (b, heads, n, d), k and v (b, kv_heads, n, d): this rank's n = s/cp tokens in the
    layout's order (`layout.shard`). heads and kv_heads must divide by cp.
    """
    cp = group.size
    heads, kv_heads, d = q.shape[1], k.shape[1], q.shape[3]
    if heads % cp or kv_heads % cp:
        raise ValueError(
            f"all-to-all attention splits heads over cp={cp}: heads {heads} and kv_heads "
            f"{kv_heads} must both be divisible by {cp}"
        )
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if cp > 1:
        q, k, v = _to_heads([q, k, v], group)
    k, v = expand_heads(k, q.shape[1]), expand_heads(v, q.shape[1])
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if causal and balanced:  # rank order is not sequence order: mask by global position
        order = permutation(q.shape[2], cp, balanced, q.device)
        y = sdpa(q, k, v, attn_mask=order[None, :] <= order[:, None], scale=scale)
    else:
        y = sdpa(q, k, v, is_causal=causal, scale=scale)  # (b, h/cp, s, d)
    return _to_sequence(y, group) if cp > 1 else y
