"""Ours against a DDP peer, pair by pair, on each rank's share of the same global batches:
what `bench dp` (AdamW) and `bench muon` (torch.optim.Muon) run in every rank.

Ours is the engine `paratrain train` builds for the configuration and `train_step`. The
peer is `DistributedDataParallel(gradient_as_bucket_view=True)`, its documented fast
configuration, with ours' buckets where a size is given (`ddp_buckets`), on a copy of the
same model, stepped by `torch_step` with the optimizer the bench gives it.
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
from paratrain.parallel.data_parallel.buckets import FIRST_BUCKET_BYTES
from paratrain.train.build import build_engine, build_model, compile_units

ONE_BUCKET_MB = 2**40  # a cap no model reaches: one bucket
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
    ddp = DistributedDataParallel(module, gradient_as_bucket_view=True, **ddp_buckets(bucket_mb))
    opt = peer_optimizer(module, cfg)
    peer = functools.partial(torch_step, ddp, opt, lr=t.lr, grad_clip=t.grad_clip)
    warm = (ours(batches[0]), peer(batches[0]))
    rows = time_pairs(ours, peer, batches[1:])
    ours.engine.replicas[0].materialize()  # ZeRO: the whole parameters, to compare
    mine = dict(ours.engine.replicas[0].module.named_parameters())
    diff = max((mine[n] - p).abs().max().item() for n, p in module.named_parameters())
    return {"losses": [warm] + [(r.ours_loss, r.peer_loss) for r in rows], "rows": rows,
            "max_param_diff": diff}  # fmt: skip


def ddp_buckets(bucket_mb: float | None) -> dict[str, Any]:
    """DDP's bucket arguments for the caps ours uses (data_parallel/buckets.py): a first
    bucket of at most 1 MiB, then `bucket_mb` each; 0, one bucket. (DDP closes a bucket at
    the parameter that crosses its cap, ours before it: the default GPT's first bucket is
    1,054,720 bytes there, 925,696 here.) Not `bucket_cap_mb`: given, it drops DDP's own
    1 MiB first bucket (torch 2.11-2.14), and at our default 25 MiB the bench's DDP held
    the default GPT in one bucket where ours has two. None: DDP's defaults."""
    if bucket_mb is None:
        return {}
    if bucket_mb <= 0:
        return {"bucket_cap_mb": ONE_BUCKET_MB}
    first = min(bucket_mb, FIRST_BUCKET_BYTES / 2**20)
    return {"bucket_cap_mb_list": [first, bucket_mb]}
