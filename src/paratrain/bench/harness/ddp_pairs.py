"""Ours against a DDP peer, pair by pair, on each rank's share of the same global batches:
what `bench dp` (AdamW) and `bench muon` (torch.optim.Muon) run in every rank.

Ours is the engine `paratrain train` builds for the configuration and `train_step`. The
peer is `DistributedDataParallel(gradient_as_bucket_view=True)`, its documented fast
configuration (with ours' bucket size where given), on a copy of the same model, stepped
by `torch_step` with the optimizer the bench gives it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from paratrain.bench.harness.pairs import time_pairs
from paratrain.bench.harness.sides import OurSide, rank_share, torch_step
from paratrain.config import RunConfig
from paratrain.mesh import Mesh
from paratrain.train.build import build_engine, build_model, compile_units

PeerOptimizer = Callable[[nn.Module, RunConfig], Any]


def ddp_pairs(
    rank: int,
    world: int,
    global_batches: list[torch.Tensor],
    cfg: RunConfig,
    peer_optimizer: PeerOptimizer,
    bucket_mb: float | None = None,
) -> dict[str, Any]:
    """One rank: per-pair times and losses after one warm-up step of each, and the largest
    parameter difference at the end."""
    from torch.nn.parallel import DistributedDataParallel

    t = cfg.train
    batches = [[b] for b in rank_share(global_batches, rank, world)]
    ours = OurSide(build_engine(cfg, mesh=Mesh.build(dp=world)), cfg)
    module = build_model(cfg)
    compile_units(module, cfg)  # --compile: the peer's blocks as ours, before DDP
    buckets: dict[str, Any] = {} if bucket_mb is None else {"bucket_cap_mb": bucket_mb}
    ddp = DistributedDataParallel(module, gradient_as_bucket_view=True, **buckets)
    opt = peer_optimizer(module, cfg)
    peer = functools.partial(torch_step, ddp, opt, lr=t.lr, grad_clip=t.grad_clip)
    warm = (ours(batches[0]), peer(batches[0]))
    rows = time_pairs(ours, peer, batches[1:])
    ours.engine.replicas[0].materialize()  # ZeRO: the whole parameters, to compare
    mine = dict(ours.engine.replicas[0].module.named_parameters())
    diff = max((mine[n] - p).abs().max().item() for n, p in module.named_parameters())
    return {"losses": [warm] + [(r.ours_loss, r.peer_loss) for r in rows], "rows": rows,
            "max_param_diff": diff}  # fmt: skip
