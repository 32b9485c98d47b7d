"""What each rank of `paratrain bench zero` runs for one stage: our step and the peer's, pair
by pair, then one counted step of each.

Ours is the engine `paratrain train --zero s` builds (`build_engine`: the wrapper that
`data_parallel` picks, over the GPT's FSDP units at stage 3) and the one `train_step`;
the peer is the stage's PyTorch-native wrapper (peer.py) and `torch_step`. Both start from
the same full GPT, take this rank's 1/dp of each global batch, clip at the same global
norm and run AdamW with the same flags at a constant learning rate.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from paratrain.bench.harness.bytes_sent import PeerTraffic, ours_by_op
from paratrain.bench.harness.pairs import time_pairs
from paratrain.bench.harness.sides import OurSide, full_parameters, rank_share, torch_step
from paratrain.bench.zero.peer import state_bytes, wrap_peer
from paratrain.config import RunConfig
from paratrain.mesh import Mesh
from paratrain.train.build import build_engine, build_model, compile_units

LOSS_RTOL = 1e-4  # per step, ours vs the peer: reordered float32 sums (bench/harness/pairs.py)
DTYPE = "float32"  # bf16 matmuls are about 50x slower on these CPUs
WARMUP = 2  # untimed steps of each side before the pairs; one more after them counts bytes


def compare_stage(
    rank: int, world: int, zero: int, global_batches: list[torch.Tensor], cfg: RunConfig
) -> dict[str, Any]:
    """One rank of one stage's comparison: times, losses, bytes held and sent, difference."""
    batches = [[b] for b in rank_share(global_batches, rank, world)]
    t = cfg.train
    replicas = cfg.parallel.replicas  # the HSDP row: replica groups on both sides
    mesh = Mesh.build(dp=world, replicas=replicas)
    ours = OurSide(build_engine(cfg, mesh), cfg)
    module = build_model(cfg)
    compile_units(module, cfg)  # --compile: the peer's blocks as ours, before wrapping
    betas = (t.beta1, t.beta2)
    model, opt = wrap_peer(zero, module, world, t.lr, t.weight_decay, betas, replicas)
    peer = functools.partial(torch_step, model, opt, lr=t.lr, grad_clip=t.grad_clip)
    # Warm-up: DDP rebuilds its buckets in its second step.
    warm = [(ours(b), peer(b)) for b in batches[:WARMUP]]
    rows = time_pairs(ours, peer, batches[WARMUP:-1])
    mesh.ledger.reset()  # the last step counts the bytes sent (untimed: counting costs)
    counted_ours = ours(batches[-1])
    ours_sent = {op: x["bytes_sent"] for op, x in ours_by_op(mesh.ledger).items()}
    norm = PeerTraffic(world, rank)  # the peer's gradient norm and clip, counted apart
    with PeerTraffic(world, rank) as traffic:
        counted = (counted_ours, peer(batches[-1], norm_scope=norm))
    a, b = ours.engine.replicas[0].full_state_dict(), full_parameters(module)
    replica, optimizer = ours.engine.replicas[0], ours.optimizer.optimizers[0]
    return {
        "times": [(r.ours_s, r.peer_s) for r in rows],
        "losses": warm + [(r.ours_loss, r.peer_loss) for r in rows] + [counted],
        "ours_bytes": _by_kind(replica.memory_report(optimizer).as_dict()),
        "torch_bytes": state_bytes(model, opt),
        "ours_sent": ours_sent,
        "torch_sent": dict(traffic.sent),
        "torch_norm_sent": dict(norm.sent),
        "torch_unsized": dict(traffic.unsized),
        "diff": max((a[n] - b[n]).abs().max().item() for n in b),
    }


def _by_kind(report: dict[str, int]) -> dict[str, int]:
    """Our bytes by kind, from the wrapper's own memory report (its total left out)."""
    return {kind: v for kind, v in report.items() if kind != "total"}
