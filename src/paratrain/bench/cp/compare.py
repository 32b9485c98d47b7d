"""What each rank of `paratrain bench cp` runs.

Ours: `ring_attention` or `ulysses_attention` (parallel/context_parallel) on this rank's
load-balanced shard of q, k, v, forward and backward. Peer: torch's
`scaled_dot_product_attention` on the whole sequence in this process (keys and values
repeated to every head, as a single-process model does), forward and backward. The first
(untimed) step of each checks the output and the gradients dq, dk, dv against the peer's
shard of them, counts the bytes per pass in the ledger and the activation bytes autograd
saves (saved-tensor hooks); then alternating timed pairs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.bench.harness.pairs import time_pairs
from paratrain.comm import CommGroup, Ledger, barrier
from paratrain.measure.activations import ActivationMeter
from paratrain.parallel.context_parallel import ring_attention, shard, ulysses_attention

METHODS = {"ring": ring_attention, "alltoall": ulysses_attention}


def inputs(shape: dict[str, int], seed: int) -> list[torch.Tensor]:
    """q (b, h, s, d), k and v (b, h_kv, s, d), and the upstream gradient w, in float32."""
    g = torch.Generator().manual_seed(seed)
    b, h, kv, s, d = (shape[k] for k in ("batch", "heads", "kv_heads", "seq", "head_dim"))
    dims = [(b, h, s, d), (b, kv, s, d), (b, kv, s, d), (b, h, s, d)]
    return [torch.randn(dim, generator=g) for dim in dims]


def peer_step(q, k, v, w) -> list[torch.Tensor]:  # noqa: ANN001
    """Whole-sequence causal attention and its input gradients, one process."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    kf, vf = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q, kf, vf, is_causal=True)
    (out * w).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad]


def ours_step(method: str, group: CommGroup, q, k, v, w) -> list[torch.Tensor]:  # noqa: ANN001
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = METHODS[method](q, k, v, group, causal=True, balanced=True)
    (out * w).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute difference over the largest magnitude of the reference."""
    return (got - want).abs().max().item() / max(want.abs().max().item(), 1e-30)


def saved_bytes(step: Any) -> int:
    """Bytes autograd saves for backward during `step` (its backward runs inside it)."""
    with ActivationMeter(nn.Module()) as meter:
        step()
    return meter.total


def compare_method(
    rank: int, world: int, method: str, shape: dict[str, int], pairs: int
) -> dict[str, Any]:
    group = CommGroup.world(Ledger(), name="cp")
    full = inputs(shape, seed=0)
    mine = [shard(t, world, rank, balanced=True, dim=2) for t in full]
    want = [shard(t, world, rank, balanced=True, dim=2) for t in peer_step(*full)]
    group.ledger.reset()
    got = ours_step(method, group, *mine)
    sent = {op: (t.messages, t.bytes_sent) for (_, op), t in group.ledger.totals().items()}
    errors = [relative_error(g, x) for g, x in zip(got, want, strict=True)]
    memory = {
        "ours": saved_bytes(lambda: ours_step(method, group, *mine)),
        "peer": saved_bytes(lambda: peer_step(*full)),
    }
    ours = lambda _batch: (ours_step(method, group, *mine), 0.0)[1]  # noqa: E731
    peer = lambda _batch: (peer_step(*full), 0.0)[1]  # noqa: E731
    rows = time_pairs(ours, peer, [[]] * pairs, sync=lambda: barrier(group))
    return {
        "rows": [(r.ours_s, r.peer_s) for r in rows],
        "relative_errors": dict(zip(("out", "dq", "dk", "dv"), errors, strict=True)),
        "sent": sent,
        "saved_bytes": memory,
    }


def compare_methods(
    rank: int, world: int, methods: list[str], shape: dict[str, int], pairs: int
) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    return [compare_method(rank, world, m, shape, pairs) for m in methods]
