"""`paratrain bench dp`, overlap: how much of the gradient all-reduce the backward hides.

Per bucket size, our `DataParallel` on random tokens: the wait after backward returns
(`finish_gradient_sync`, what is exposed) against the same buckets all-reduced back to
back with nothing else running. hidden = 1 - exposed / alone.
"""

from __future__ import annotations

import logging
import statistics
import time

import torch

from paratrain import comm
from paratrain.config import RunConfig
from paratrain.mesh import Mesh
from paratrain.parallel.data_parallel import DataParallel
from paratrain.spawn import run_ranks
from paratrain.train.build import build_model

log = logging.getLogger(__name__)
BUCKET_MBS = [0.25, 1.0, 2.0, 0.0]  # 0: the whole model in one bucket
STEPS = 10


def measure_overlap(rank: int, world: int, bucket_mbs: list[float], steps: int) -> list[dict]:
    """How much of the gradient all-reduce time the backward pass hides, per bucket size.

    comm_s: the same buckets all-reduced back to back with nothing else running;
    exposed_s: the wait after backward returns (finish_gradient_sync).
    hidden = 1 - exposed / comm.
    """
    cfg = RunConfig()
    mesh = Mesh.build(dp=world)
    batch = torch.randint(
        0,
        256,
        (cfg.train.global_batch // world, cfg.train.seq_len + 1),
        generator=torch.Generator().manual_seed(rank),
    )
    out = []
    for bucket_mb in bucket_mbs:
        model = DataParallel(build_model(cfg), mesh.group("dp"), bucket_mb=bucket_mb)
        exposed, alone = [], []
        for _ in range(steps + 1):
            model.zero_grad()
            model(batch[:, :-1], batch[:, 1:]).backward()
            start = time.perf_counter()
            model.finish_gradient_sync()
            exposed.append(time.perf_counter() - start)
            start = time.perf_counter()
            for bucket in model.buckets:
                comm.all_reduce(bucket.buffer.clone(), mesh.group("dp"))
            alone.append(time.perf_counter() - start)
        e, c = statistics.median(exposed[1:]), statistics.median(alone[1:])
        out.append(
            {
                "bucket_mb": bucket_mb,
                "buckets": len(model.buckets),
                "exposed_s": e,
                "comm_s": c,
                "hidden_fraction": max(0.0, 1.0 - e / c),
            }
        )
    return out


def run_overlap(world: int) -> list[dict]:
    """Measure at `world` ranks and log one line per bucket size; rank 0's measurements."""
    overlap = run_ranks(measure_overlap, world, BUCKET_MBS, STEPS, timeout=1800)[0]
    for o in overlap:
        label = "one bucket" if o["bucket_mb"] == 0 else f"{o['bucket_mb']} MiB"
        log.info(
            "overlap, %s (%d buckets): all-reduce alone %.2f ms, exposed after backward "
            "%.2f ms, hidden %.0f%%",
            label, o["buckets"], 1e3 * o["comm_s"], 1e3 * o["exposed_s"],
            100 * o["hidden_fraction"],
        )  # fmt: skip
    return overlap
