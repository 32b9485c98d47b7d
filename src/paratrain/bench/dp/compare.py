"""What each rank of `paratrain bench dp` runs against DDP: our step and the peer's, pair by
pair, on this rank's share of the same global batches.

Ours is the engine `paratrain train --dp k` builds (`build_engine`: `DataParallel` with
the configuration's bucket size) and the one `train_step`. The peer is
`DistributedDataParallel(gradient_as_bucket_view=True)` with our bucket layout
(`ddp_buckets`), its documented fast configuration, stepped by `torch_step`. Both start
from the same full GPT, clip at the same global gradient norm and run AdamW(foreach=True)
at a constant learning rate.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paratrain.bench.harness.ddp_pairs import ddp_pairs
from paratrain.config import RunConfig
from paratrain.parallel.data_parallel.adamw import adamw


def peer_adamw(module: nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
    t = cfg.train
    return adamw(module, t.lr, t.weight_decay, (t.beta1, t.beta2))


def compare_with_ddp(
    rank: int, world: int, global_batches: list[torch.Tensor], cfg: RunConfig
) -> dict[str, Any]:
    """One rank: per-pair times and losses after one warm-up step of each, and the largest
    parameter difference at the end."""
    return ddp_pairs(rank, world, global_batches, cfg, peer_adamw, cfg.parallel.bucket_mb)
