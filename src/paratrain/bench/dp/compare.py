"""What each rank of `paratrain bench dp` runs against DDP: our step and the peer's, pair by
pair, on this rank's share of the same global batches.

Ours is the engine `paratrain train --dp k` builds (`build_engine`: `DataParallel` with
the configuration's bucket size) and the one `train_step`. The peer is
`DistributedDataParallel(gradient_as_bucket_view=True, bucket_cap_mb=<ours>)`, its
documented fast configuration, stepped by `torch_step`. Both start from the same full
GPT, clip at the same global gradient norm and run AdamW(foreach=True) at a constant
learning rate.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from paratrain.bench.harness.pairs import time_pairs
from paratrain.bench.harness.sides import OurSide, rank_share, torch_step
from paratrain.config import RunConfig
from paratrain.mesh import Mesh
from paratrain.parallel.data_parallel.adamw import adamw
from paratrain.train.build import build_engine, build_model, compile_units


def compare_with_ddp(
    rank: int, world: int, global_batches: list[torch.Tensor], cfg: RunConfig
) -> dict[str, Any]:
    """One rank: per-pair times and losses after one warm-up step of each, and the largest
    parameter difference at the end."""
    from torch.nn.parallel import DistributedDataParallel

    t = cfg.train
    batches = [[b] for b in rank_share(global_batches, rank, world)]
    ours = OurSide(build_engine(cfg, mesh=Mesh.build(dp=world)), cfg)
    module = build_model(cfg)
    compile_units(module, cfg)  # --compile: the peer's blocks as ours, before DDP
    ddp = DistributedDataParallel(
        module, bucket_cap_mb=cfg.parallel.bucket_mb, gradient_as_bucket_view=True
    )
    opt = adamw(module, t.lr, t.weight_decay, (t.beta1, t.beta2))
    peer = functools.partial(torch_step, ddp, opt, lr=t.lr, grad_clip=t.grad_clip)
    warm = (ours(batches[0]), peer(batches[0]))
    rows = time_pairs(ours, peer, batches[1:])
    mine = dict(ours.engine.replicas[0].module.named_parameters())
    diff = max((mine[n] - p).abs().max().item() for n, p in module.named_parameters())
    return {"losses": [warm] + [(r.ours_loss, r.peer_loss) for r in rows], "rows": rows,
            "max_param_diff": diff}  # fmt: skip
