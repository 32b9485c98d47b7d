"""What each rank of `paratrain bench moe` runs, for each tokens-per-rank N of the sweep.

Routing is uniform at random, k distinct experts per token, from a generator seeded by
(N, rank), so every rank can recompute every other rank's counts (the formula's inputs)
without asking. The rows, grouped by expert as models/moe.py hands them over, go through
`ExpertParallel` with identity experts: what is timed is the counts all-to-all, the
dispatch, the regrouping and the combine, forward and backward. Two algorithms of the
all-to-all alternate in timed pairs: ours, the pairwise exchange on send/recv, and the
backend's native all_to_all_single (gloo's).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paratrain.bench.harness.pairs import time_pairs
from paratrain.comm import CommGroup, Ledger, barrier
from paratrain.parallel.expert_parallel import ExpertParallel


class Identity(nn.Module):
    """Experts that return their rows: the cost measured is the exchange alone."""

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return rows.clone()


def routed_counts(tokens: int, experts: int, top_k: int, rank: int) -> torch.Tensor:
    """(E,) assignments of this rank's tokens per expert, uniform routing."""
    g = torch.Generator().manual_seed(1000 * tokens + rank)
    choice = torch.rand(tokens, experts, generator=g).topk(top_k, dim=1).indices
    return torch.bincount(choice.flatten(), minlength=experts)


def sends_recvs(
    tokens: int, experts: int, top_k: int, rank: int, world: int
) -> tuple[list[int], list[int]]:
    """Rows this rank sends to each rank, and receives from each (the formula's inputs)."""
    per = experts // world
    counts = [
        routed_counts(tokens, experts, top_k, r).view(world, per).sum(1) for r in range(world)
    ]
    return counts[rank].tolist(), [int(c[rank]) for c in counts]


def measure(
    rank: int, world: int, tokens: int, d_model: int, experts: int, top_k: int, pairs: int
) -> dict[str, Any]:
    group = CommGroup.world(Ledger(), name="ep")
    counts = routed_counts(tokens, experts, top_k, rank)
    g = torch.Generator().manual_seed(rank)
    x, w = (torch.randn(int(counts.sum()), d_model, generator=g) for _ in range(2))
    layers = {
        algo: ExpertParallel(Identity(), experts, group, algo) for algo in ("pairwise", "native")
    }

    def step(algo: str) -> tuple[torch.Tensor, torch.Tensor]:
        rows = x.detach().requires_grad_()
        y = layers[algo](rows, counts)
        (y * w).sum().backward()
        assert rows.grad is not None
        return y.detach(), rows.grad

    sent, exact = {}, {}
    for algo in layers:
        group.ledger.reset()
        y, grad = step(algo)
        exact[algo] = torch.equal(y, x) and torch.equal(grad, w)
        totals = group.ledger.totals().items()
        sent[algo] = sum(t.bytes_sent for (_, op), t in totals if op == "all_to_all")
    ours = lambda _b: (step("pairwise"), 0.0)[1]  # noqa: E731
    peer = lambda _b: (step("native"), 0.0)[1]  # noqa: E731
    rows = time_pairs(ours, peer, [[]] * pairs, sync=lambda: barrier(group))
    sends, recvs = sends_recvs(tokens, experts, top_k, rank, world)
    return {
        "rows": [(r.ours_s, r.peer_s) for r in rows],
        "exact": exact,
        "sent": sent,
        "sends": sends,
        "recvs": recvs,
    }


def sweep(
    rank: int, world: int, tokens: list[int], d_model: int, experts: int, top_k: int, pairs: int
) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    return [measure(rank, world, n, d_model, experts, top_k, pairs) for n in tokens]
