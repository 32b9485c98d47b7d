"""What each rank of `paratrain bench muon` runs: our step with `--optimizer muon` against
the PyTorch-native way of training with Muon, pair by pair, on this rank's share of the
same global batches.

The peers, each its documented configuration, on the same GPT and the same split (the
plan's matrices to Muon, the rest to AdamW with decay on matrices only):
- zero 0: `DistributedDataParallel(gradient_as_bucket_view=True)` with torch.optim.Muon and
  AdamW(foreach=True): every rank orthogonalizes every matrix;
- zero 1: the same DDP with one `ZeroRedundancyOptimizer` per optimizer class: each rank
  steps (and orthogonalizes) a greedy partition of whole parameters, then broadcasts them.
Ours spreads the orthogonalizations over the ranks by cost (plan/muon.py) and all-gathers
the results (zero 0), or sends the matrices' pieces to their owners and back (zero 1).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paratrain.bench.harness.ddp_pairs import ddp_pairs
from paratrain.config import RunConfig
from paratrain.models.plans import PLANS
from paratrain.parallel.data_parallel.adamw import param_groups
from paratrain.parallel.data_parallel.muon import muon_matrix_names

PEERS = {
    0: "DistributedDataParallel(gradient_as_bucket_view=True) + torch.optim.Muon(matrices) + "
    "AdamW(foreach=True)",
    1: "DistributedDataParallel(gradient_as_bucket_view=True) + "
    "ZeroRedundancyOptimizer(optimizer_class=torch.optim.Muon) for the matrices + "
    "ZeroRedundancyOptimizer(optimizer_class=AdamW, foreach=True) for the rest",
}


class Optimizers:
    """Several torch optimizers driven as one (what torch_step sets and steps)."""

    def __init__(self, *optimizers: Any) -> None:
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for o in self.optimizers for g in o.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for o in self.optimizers:
            o.step()


def peer_optimizer(module: nn.Module, cfg: RunConfig) -> Optimizers:
    """torch.optim.Muon for the plan's matrices and AdamW for the rest, plain (zero 0) or
    each under ZeroRedundancyOptimizer (zero 1)."""
    t, zero = cfg.train, cfg.parallel.zero
    names = muon_matrix_names(module, PLANS[cfg.model.arch].muon_matrices)
    named = dict(module.named_parameters())
    others = [n for n in named if n not in names]
    muon_args: dict[str, Any] = dict(
        lr=t.lr, weight_decay=t.weight_decay, momentum=t.muon_momentum,
        nesterov=t.muon_nesterov, ns_steps=t.muon_ns_steps,
        adjust_lr_fn=t.muon_lr_adjust.replace("-", "_"),
    )  # fmt: skip
    rest = param_groups(module, t.weight_decay, others)
    betas = (t.beta1, t.beta2)
    matrices = [named[n] for n in names]
    if zero == 0:
        muon = torch.optim.Muon(matrices, **muon_args)
        return Optimizers(muon, torch.optim.AdamW(rest, lr=t.lr, betas=betas, foreach=True))
    from torch.distributed.optim import ZeroRedundancyOptimizer

    sharded_muon = ZeroRedundancyOptimizer(matrices, optimizer_class=torch.optim.Muon, **muon_args)
    adam = ZeroRedundancyOptimizer(
        rest, optimizer_class=torch.optim.AdamW, lr=t.lr, betas=betas, foreach=True
    )
    return Optimizers(sharded_muon, adam)


def compare_muon(
    rank: int, world: int, global_batches: list[torch.Tensor], cfg: RunConfig
) -> dict[str, Any]:
    """One rank: per-pair times and losses after one warm-up step of each, and the largest
    parameter difference at the end."""
    return ddp_pairs(rank, world, global_batches, cfg, peer_optimizer)
