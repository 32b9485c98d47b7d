"""What expert-parallel dispatch costs one rank per MoE layer, as formulas (docs/experts.md);
the runtime's counts are held to them by tests/test_expert_parallel.py, and plan/moe.py
charges the planner's imbalance on top of `expected_token_bytes`.

`sends[p]`: rows this rank dispatches to ep rank p (its kept assignments for p's experts);
`recvs[p]`: rows it receives from p. A row is one token's activation, d·elem bytes.
Forward: one all-to-all of counts (E/ep int64 to each other rank), the dispatch (sends)
and the combine (recvs going back). Backward: the combine's gradient travels like the
dispatch and the dispatch's like the combine, so the token bytes are the same; no counts.
"""

from __future__ import annotations

COUNT_BYTES = 8  # counts are int64


def counts_bytes(num_experts: int, ep: int) -> int:
    """The counts all-to-all: E/ep int64 to each of the ep - 1 other ranks."""
    return (ep - 1) * (num_experts // ep) * COUNT_BYTES


def token_bytes(sends: list[int], recvs: list[int], rank: int, d_model: int, elem: int) -> int:
    """Bytes of token rows one rank sends in one pass (forward or backward), both
    all-to-alls together: every row but those that stay on this rank, each way."""
    others = [p for p in range(len(sends)) if p != rank]
    return sum(sends[p] + recvs[p] for p in others) * d_model * elem


def expected_token_bytes(tokens: float, top_k: int, ep: int, d_model: int, elem: int) -> float:
    """token_bytes when routing is uniform and nothing is dropped: each of the k·N
    assignments of a rank's N tokens leaves it with probability (ep - 1)/ep, and as many
    arrive, 2·k·N·d·elem·(ep - 1)/ep per pass."""
    return 2 * top_k * tokens * d_model * elem * (ep - 1) / ep
