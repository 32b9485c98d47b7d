"""`paratrain bench dp`, straggler: synchronous against asynchronous data parallelism when
one rank is 3 times slower, both through the real training loop.

sync: 2 ranks, rank 1 slowed; async: rank 0 serves the parameters, ranks 1 and 2 work,
rank 2 slowed. Reported: samples per second, the final and validation losses, and the
async run's staleness histogram.
"""

from __future__ import annotations

import logging
import time

from paratrain.config import RunConfig
from paratrain.data.tokens import load_tokens
from paratrain.mesh import Mesh
from paratrain.spawn import run_ranks
from paratrain.train.async_loop import train_async
from paratrain.train.loop import train

log = logging.getLogger(__name__)


def sync_vs_async(rank: int, world: int, steps: int, straggler: str, mode: str) -> dict | None:
    cfg = RunConfig()
    cfg.parallel.dp, cfg.parallel.dp_mode, cfg.parallel.straggler = world, mode, straggler
    cfg.train.steps, cfg.train.warmup_steps, cfg.train.val_batches = steps, 5, 8
    cfg.train.micro_batch = 4
    start = time.perf_counter()
    run = train_async if mode == "async" else train
    result = run(cfg, Mesh.build(dp=world), load_tokens(""))
    if rank != 0:
        return None
    elapsed = time.perf_counter() - start
    return {
        "mode": mode,
        "world_size": world,
        "samples": steps * cfg.train.global_batch,
        "seconds": elapsed,
        "samples_per_s": steps * cfg.train.global_batch / elapsed,
        "final_loss": result.metrics[-1].loss,
        "val_loss": result.val_loss,
        **result.extra.get("async", {}),
    }


def run_straggler(steps: int) -> list[dict]:
    """Both modes with a 3x straggler; one summary per mode, logged."""
    out = []
    for mode, world in (("sync", 2), ("async", 3)):
        # async: rank 0 serves, ranks 1 and 2 work; rank `world - 1` is 3x slower in both
        run = run_ranks(sync_vs_async, world, steps, f"{world - 1}:3", mode, timeout=1800)[0]
        out.append(run)
        log.info(
            "%s with a 3x straggler: %.1f samples/s, final loss %.3f, val %.3f%s",
            mode, run["samples_per_s"], run["final_loss"], run["val_loss"],
            f", staleness {run['staleness_histogram']}" if mode == "async" else "",
        )  # fmt: skip
    return out
