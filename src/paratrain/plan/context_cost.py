"""What context-parallel attention costs one rank per layer: messages, bytes and matmul
FLOPs, as pure formulas (docs/context-parallel.md derives them). The tests hold the
ledger's counts and FlopCounterMode's to them exactly, and plan/context.py builds the
planner's cp entries from them.

b batch, s the whole sequence, d the head dimension, `elem` bytes per element. Shapes
that divide give exact integers; the planner may pass fractional head counts (per tp rank).
The chunk layout (which chunks a rank holds) is the runtime's,
parallel/context_parallel/layout.py; `ring_blocks` is its count in closed form, held equal
to the layout by tests/test_context_parallel.py.
"""

from __future__ import annotations


def ring_messages(cp: int, backward: bool = False) -> int:
    """Forward: keys and values, cp - 1 hops. Backward: those again, and their gradients."""
    return (cp - 1) * (2 if backward else 1)


def ring_message_bytes(b: int, s: int, kv_heads: float, d: int, elem: int, cp: int) -> float:
    """One hop: keys and values of s/cp tokens, 2·b·(s/cp)·h_kv·d·elem."""
    return 2 * b * s / cp * kv_heads * d * elem


def ring_bytes(
    b: int, s: int, kv_heads: float, d: int, elem: int, cp: int, backward: bool = False
) -> float:
    """Bytes one rank sends: 2·b·s·h_kv·d·elem·(cp-1)/cp forward, twice that backward."""
    return ring_messages(cp, backward) * ring_message_bytes(b, s, kv_heads, d, elem, cp)


def ulysses_messages(cp: int) -> int:
    """One fused all-to-all in, one out: cp - 1 messages each, in either pass."""
    return 2 * (cp - 1)


def ulysses_bytes(
    b: int, s: int, heads: float, kv_heads: float, d: int, elem: int, cp: int
) -> float:
    """Bytes one rank sends per pass (forward and backward alike): all of q, k, v and of
    the output but the chunk it keeps, b·(s/cp)·(2·h + 2·h_kv)·d·elem·(cp-1)/cp."""
    per_token = (2 * heads + 2 * kv_heads) * d * elem
    return b * s / cp * per_token * (cp - 1) / cp


def ring_blocks(rank: int, cp: int, causal: bool, balanced: bool) -> int:
    """How many (chunk x chunk) blocks of attention rank `rank` computes, the diagonal
    ones counted whole (they are computed as full blocks and masked). Query chunk i sees
    key chunks 0..i under a causal mask, all of them without. Balanced: 2·cp chunks, rank r
    holds r and 2·cp-1-r, so (r + 1) + (2·cp - r) = 2·cp + 1 blocks on every rank; plain:
    cp chunks, rank r holds chunk r alone, r + 1 blocks."""
    if not causal:
        return (2 * cp) * 2 if balanced else cp
    return 2 * cp + 1 if balanced else rank + 1


def _chunk_tokens(s: int, cp: int, balanced: bool) -> int:
    """Tokens per chunk: s / (2·cp) balanced, s / cp plain (the runtime refuses the rest)."""
    return s // (2 * cp if balanced else cp)


def ring_flops(
    b: int,
    heads: int,
    s: int,
    d: int,
    cp: int,
    rank: int,
    causal: bool,
    balanced: bool,
    backward: bool = False,
) -> int:
    """Matmul FLOPs of one rank's ring attention as FlopCounterMode counts them (2 per
    multiply-add): per block of L queries and L keys, q·kᵀ and p·v forward (2·2·b·h·L²·d);
    backward recomputes q·kᵀ and adds dv, dp, dq and dk (5·2·b·h·L²·d)."""
    length = _chunk_tokens(s, cp, balanced)
    matmuls = 5 if backward else 2
    return ring_blocks(rank, cp, causal, balanced) * matmuls * 2 * b * heads * length**2 * d
