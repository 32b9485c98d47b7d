"""Continuing a run from a checkpoint: load it, say how the run continues, re-warm the
learning rate when the world size changed."""

from __future__ import annotations

import logging
from typing import Any

from paratrain import checkpoint
from paratrain.checkpoint import Checkpoint
from paratrain.checkpoint import load as checkpoint_load
from paratrain.config import RunConfig
from paratrain.mesh import Mesh
from paratrain.train.build import seed_rank_stream
from paratrain.train.optim import Rewarmup

log = logging.getLogger(__name__)


def restore(
    ckpt: Checkpoint, engine: Any, optimizer: Any, mesh: Mesh, cfg: RunConfig, peak_lr: float
) -> tuple[int, Rewarmup]:
    """Load `ckpt` into the engine and optimizer (collective); return the first step to run
    and the re-warmup of the learning rate."""
    saved = checkpoint_load.load(ckpt, engine, optimizer, mesh, cfg)
    first = int(saved["step"])
    if saved["layout"] != checkpoint.layout_of(cfg, mesh):  # other ranks, other work
        seed_rank_stream(cfg.train.seed, mesh.global_rank, first)
    return first, resumed_schedule(saved, cfg, mesh, peak_lr)


def resumed_schedule(saved: dict[str, Any], cfg: RunConfig, mesh: Mesh, lr: float) -> Rewarmup:
    """Log how the resumed run continues; re-warm when the world size changed.

    The global batch is kept (check_compatible refuses another), so only the number of
    micro-batches per replica changes with dp; the peak rate follows from the global batch,
    so it is the same, and is printed with the layouts for the user to see.
    """
    t, before, now = cfg.train, saved["layout"], checkpoint.layout_of(cfg, mesh)
    step = int(saved["step"])
    k_before = t.global_batch // (t.micro_batch * before["dp"])
    k_now = t.global_batch // (t.micro_batch * now["dp"])
    ramp = t.rewarmup_steps if before["world_size"] != now["world_size"] else 0
    log.info(
        "resuming at step %d of %d, saved on %s, now %s; micro-batches per replica per step "
        "%d -> %d (global batch %d kept); peak learning rate %.3g (%s scaling)%s",
        step,
        t.steps,
        _layout_text(before),
        _layout_text(now),
        k_before,
        k_now,
        t.global_batch,
        lr,
        t.lr_scaling,
        f"; world size changed: learning rate re-warmed over {ramp} steps" if ramp else "",
    )
    return Rewarmup(step, ramp)


def _layout_text(layout: dict[str, int]) -> str:
    cp = f" x cp {layout['cp']}" if "cp" in layout else ""
    return "world {world_size} (dp {dp} x pp {pp} x tp {tp}{cp_text}, zero {zero})".format(
        **layout, cp_text=cp
    )
