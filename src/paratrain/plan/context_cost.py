"""What context-parallel attention costs one rank per layer: messages, bytes and matmul
FLOPs, as pure formulas (docs/context-parallel.md derives them). The tests hold the
ledger's counts and FlopCounterMode's to them exactly; the planner can use them as they are.

b batch, s the whole sequence, d the head dimension, `elem` bytes per element.
"""

from __future__ import annotations

from paratrain.parallel.context_parallel.layout import chunk_length, chunks_of, visibility


def ring_messages(cp: int, backward: bool = False) -> int:
    """Forward: keys and values, cp - 1 hops. Backward: those again, and their gradients."""
    return (cp - 1) * (2 if backward else 1)


def ring_bytes(
    b: int, s: int, kv_heads: int, d: int, elem: int, cp: int, backward: bool = False
) -> int:
    """Bytes one rank sends: 2·b·s·h_kv·d·elem·(cp-1)/cp forward, twice that backward."""
    per_message = 2 * b * (s // cp) * kv_heads * d * elem  # k and v of s/cp tokens
    return ring_messages(cp, backward) * per_message


def ulysses_messages(cp: int) -> int:
    """One fused all-to-all in, one out: cp - 1 messages each, in either pass."""
    return 2 * (cp - 1)


def ulysses_bytes(b: int, s: int, heads: int, kv_heads: int, d: int, elem: int, cp: int) -> int:
    """Bytes one rank sends per pass (forward and backward alike): all of q, k, v and of
    the output but the chunk it keeps, b·(s/cp)·(2·h + 2·h_kv)·d·elem·(cp-1)/cp."""
    per_token = (2 * heads + 2 * kv_heads) * d * elem
    return b * (s // cp) * per_token * (cp - 1) // cp


def ring_blocks(rank: int, cp: int, causal: bool, balanced: bool) -> int:
    """How many (chunk x chunk) blocks of attention rank `rank` computes, the diagonal
    ones counted whole (they are computed as full blocks and masked)."""
    every = [c for r in range(cp) for c in chunks_of(r, cp, balanced)]
    return sum(
        1 for q in chunks_of(rank, cp, balanced) for kv in every if visibility(q, kv, causal)
    )


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
    length = chunk_length(s, cp, balanced)
    matmuls = 5 if backward else 2
    return ring_blocks(rank, cp, causal, balanced) * matmuls * 2 * b * heads * length**2 * d
