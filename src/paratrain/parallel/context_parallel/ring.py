"""Ring attention: queries stay, keys and values travel around the context-parallel ring.

Liu, Zaharia & Abbeel, "Ring Attention with Blockwise Transformers", arXiv:2310.01889.
Each rank holds its tokens' q, k, v (layout.py: plain or load-balanced). In forward, at
step s = 0 .. cp-1 rank r attends with the keys and values of rank (r - s) mod cp, merging
each block into its running output by the log-sum-exp rule (blocks.py); meanwhile the
same keys and values are already on their way to rank r + 1. Keys and values travel as
one stacked tensor, one message per step: cp - 1 messages of 2·b·(s/cp)·h_kv·d elements.

Backward passes them around again, and with them the key/value gradients: the gradient of
rank j's keys and values is collected as it travels j+1 -> j+2 -> ... -> j-1 and then
returns home, where rank j adds its own share: cp - 1 more messages of the same size, so
backward moves twice forward's bytes (docs/context-parallel.md).

Why this order: every transfer is posted before the compute of the current step, so it
runs while the rank computes; the wait comes after. The send and the receive of a step
are one group call, as NCCL needs when left and right are the same rank (cp 2).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor

from paratrain import comm
from paratrain.comm.group import CommGroup
from paratrain.parallel.context_parallel.blocks import (
    attend_block,
    attend_block_backward,
    expand_heads,
    fold_heads,
    merge,
)
from paratrain.parallel.context_parallel.layout import chunk_length, chunks_of, visible_keys

Pair = tuple[comm.Handle[torch.Tensor], comm.Handle[torch.Tensor]]  # (receive, send)
# Per query chunk, its running (out, lse): None until its first block.
State = list[tuple[torch.Tensor | None, torch.Tensor | None]]


def _pass_on(t: torch.Tensor, group: CommGroup) -> Pair:
    """Send `t` to the next rank and receive the previous rank's into a new buffer."""
    left, right = (group.rank - 1) % group.size, (group.rank + 1) % group.size
    # One group call: with cp 2 left is right, and a receive posted alone ahead of the
    # send would block NCCL's stream for that pair on both ranks (comm/p2p.py: sendrecv).
    return comm.sendrecv(t, right, torch.empty_like(t), left, group)


def _arrived(handles: Pair) -> torch.Tensor:
    incoming, outgoing = handles
    outgoing.wait()
    return incoming.wait()


def _take(x: torch.Tensor, seen: list[int], length: int) -> torch.Tensor:
    """The seen chunks of a (b, h, n, d) tensor, concatenated along the sequence."""
    pieces = [x.narrow(2, i * length, length) for i in seen]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=2)


class _Spec:
    """What every step needs to know: this rank's chunks, the mask and the scale."""

    def __init__(self, group: CommGroup, causal: bool, balanced: bool, scale: float, n: int):
        self.cp, self.rank, self.causal, self.scale = group.size, group.rank, causal, scale
        self.balanced = balanced
        self.mine = chunks_of(group.rank, group.size, balanced)
        self.length = n // len(self.mine)  # tokens per chunk

    def source_chunks(self, step: int) -> tuple[int, ...]:
        return chunks_of((self.rank - step) % self.cp, self.cp, self.balanced)


def _attend_source(q: torch.Tensor, kv: torch.Tensor, spec: _Spec, step: int, state: State) -> None:
    """Fold the keys and values of step `step`'s source into every query chunk's (out, lse)."""
    heads, length = q.shape[1], spec.length
    for qi, chunk in enumerate(spec.mine):
        seen, mask = visible_keys(chunk, spec.source_chunks(step), spec.causal, length, q.device)
        if not seen:  # causal: this block lies wholly above the diagonal, no work
            continue
        k, v = (expand_heads(_take(t, seen, length), heads) for t in kv)
        q_chunk = q.narrow(2, qi * length, length)
        state[qi] = merge(*state[qi], *attend_block(q_chunk, k, v, spec.scale, mask))


def _forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: CommGroup, spec: _Spec
) -> tuple[torch.Tensor, torch.Tensor]:
    kv = torch.stack([k, v])  # (2, b, h_kv, n, d): one message per step
    state: State = [(None, None)] * len(spec.mine)
    for step in range(spec.cp):
        last = step == spec.cp - 1
        handles = None if last else _pass_on(kv, group)  # posted before this step's compute
        _attend_source(q, kv, spec, step, state)
        if handles is not None:
            kv = _arrived(handles)
    whole = [(o, lse) for o, lse in state if o is not None and lse is not None]
    assert len(whole) == len(state), "step 0 attends every chunk to its own keys"
    out = torch.cat([o for o, _ in whole], dim=2)  # (b, h, n, d)
    return out, torch.cat([lse for _, lse in whole], dim=2)  # lse (b, h, n)


def _grad_source(
    q: torch.Tensor,
    kv: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    dq: torch.Tensor,
    spec: _Spec,
    step: int,
) -> torch.Tensor:
    """This rank's share of the gradient of step `step`'s keys and values; adds into dq."""
    heads, kv_heads, length = q.shape[1], kv.shape[2], spec.length
    dkv = torch.zeros_like(kv)  # (2, b, h_kv, n, d)
    for qi, chunk in enumerate(spec.mine):
        seen, mask = visible_keys(chunk, spec.source_chunks(step), spec.causal, length, q.device)
        if not seen:
            continue
        k, v = (expand_heads(_take(t, seen, length), heads) for t in kv)
        q_i, dout_i, lse_i, delta_i = (
            t.narrow(2, qi * length, length) for t in (q, dout, lse, delta)
        )
        dq_i, dk, dv = attend_block_backward(q_i, k, v, spec.scale, mask, lse_i, delta_i, dout_i)
        dq.narrow(2, qi * length, length).add_(dq_i)
        for which, grad in enumerate((fold_heads(dk, kv_heads), fold_heads(dv, kv_heads))):
            for pos, i in enumerate(seen):
                dkv[which].narrow(2, i * length, length).add_(grad.narrow(2, pos * length, length))
    return dkv


def _backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    group: CommGroup,
    spec: _Spec,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    kv = torch.stack([k, v])
    delta = (dout * out).sum(-1)  # (b, h, n): rowsum(dO ∘ O)
    dq = torch.zeros_like(q)
    own = torch.zeros_like(kv)  # gradients of my keys and values, set at step 0
    travelling = None  # the handles of the gradients passing through (step >= 1)
    for step in range(spec.cp):
        last = step == spec.cp - 1
        handles = None if last else _pass_on(kv, group)
        dkv = _grad_source(q, kv, dout, lse, delta, dq, spec, step)
        if step == 0:
            own = dkv
        else:  # add to what ranks before me collected for these keys, then pass it on
            if travelling is not None:
                dkv += _arrived(travelling)
            # At the last step the source is rank r + 1: what it is sent is its own, home.
            travelling = _pass_on(dkv, group)
        if handles is not None:
            kv = _arrived(handles)
    if travelling is not None:  # my keys' gradients from every other rank, back home
        own = own + _arrived(travelling)
    return dq, own[0], own[1]


class _RingAttention(torch.autograd.Function):
    apply: ClassVar[Callable[[Tensor, Tensor, Tensor, CommGroup, _Spec], Tensor]]  # untyped

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, group: CommGroup, spec: _Spec) -> Tensor:
        out, lse = _forward(q, k, v, group, spec)
        # Stored token-major (b, n, h, d), as fused attention kernels return it: a model's
        # (b, h, n, d) -> (b, n, h·d) reshape for its output projection is then a view,
        # and the output saved here is the tensor that projection saves, not a second copy.
        out = out.transpose(1, 2).contiguous().transpose(1, 2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.spec = group, spec
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor, Tensor, Tensor, None, None]:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(q, k, v, out, lse, dout.contiguous(), ctx.group, ctx.spec)
        return dq, dk, dv, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: CommGroup,
    causal: bool = True,
    balanced: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence's keys, held across `group`.

    q (b, heads, n, d), k and v (b, kv_heads, n, d): this rank's n = s/cp tokens in the
    layout's order (`layout.shard`); `balanced` picks the load-balanced layout, which
    every rank of the group must share. Returns (b, heads, n, d), this rank's tokens.
    """
    b, heads, n, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[2:] != (n, d) or heads % k.shape[1]:
        raise ValueError(
            f"ring attention: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} must be "
            f"(b, heads, n, d) and (b, kv_heads, n, d) with kv_heads dividing heads"
        )
    chunk_length(n * group.size, group.size, balanced)  # the chunks must be equal
    spec = _Spec(group, causal, balanced, 1.0 / math.sqrt(d) if scale is None else scale, n)
    return _RingAttention.apply(q, k.contiguous(), v.contiguous(), group, spec)
