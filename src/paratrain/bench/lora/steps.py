"""What each rank of `paratrain bench lora` runs: the step `paratrain train` builds for a
full fine-tune and for a LoRA fine-tune of the same model, alternating on this rank's
share of the same global batches, and each side's model state on this rank (the bytes its
wrappers hold: the planner's count, held exact by tests/test_lora_training.py)."""

from __future__ import annotations

import copy
from typing import Any

import torch

from paratrain import comm
from paratrain.bench.harness.pairs import time_pairs
from paratrain.bench.harness.sides import OurSide, rank_share
from paratrain.config import RunConfig
from paratrain.mesh import Mesh
from paratrain.train.build import build_engine


def lora_against_full(
    rank: int, world: int, global_batches: list[torch.Tensor], cfg: RunConfig
) -> dict[str, Any]:
    """One rank: per-pair times (LoRA as `ours`, the full fine-tune as `peer`) after one
    warm-up step of each, and both sides' model state in bytes."""
    full = copy.deepcopy(cfg)
    full.train.lora_rank = 0
    mesh = Mesh.build(dp=world)
    lora_side = OurSide(build_engine(cfg, mesh), cfg)
    full_side = OurSide(build_engine(full, mesh), full)
    batches = [[b] for b in rank_share(global_batches, rank, world)]
    lora_side(batches[0]), full_side(batches[0])
    dp = mesh.group("dp")
    rows = time_pairs(lora_side, full_side, batches[1:], sync=lambda: comm.barrier(dp))
    state = {
        name: side.engine.memory_report(side.optimizer)
        for name, side in (("lora", lora_side), ("full", full_side))
    }
    return {"rows": rows, "state": state}
