"""`paratrain bench dp`: our DataParallel against torch DistributedDataParallel, overlap, and
sync against async data parallelism under a straggler.

Peer: `DistributedDataParallel(gradient_as_bucket_view=True, bucket_cap_mb=<ours>)`, its
documented fast configuration, on a copy of the same model with the same initial weights,
the same batches, AdamW(foreach=True), one thread per rank and the same timer. Each pair
runs one step of each, alternating which goes first; the report gives both medians, the
median and spread of the pairwise ratios, and the largest parameter difference at the end.
The bench fails if the two loss curves differ by more than LOSS_RTOL.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any

import torch
from torch import nn

from paratrain.bench.harness.spawn import run_ranks
from paratrain.config import RunConfig
from paratrain.mesh import Mesh
from paratrain.parallel.adamw import adamw
from paratrain.parallel.data_parallel import DataParallel
from paratrain.train.build import build_model
from paratrain.train.data import BatchSampler, load_tokens

log = logging.getLogger(__name__)
LOSS_RTOL = 1e-4
WORLD = 2  # on 2 cores only 2-rank timings mean anything


def step_pair_side(model: nn.Module, opt: Any, batch: torch.Tensor, ours: bool) -> float:
    """One timed step of either side of a data-parallel comparison (ours or torch's peer).

    Ours keep gradients in their own buffers (zeroed by the wrapper) and finish the sync
    explicitly; torch's wrappers sync inside backward.
    """
    if ours:
        model.zero_grad()  # the bucket buffers: gradients are views into them
    else:
        opt.zero_grad(set_to_none=True)
    loss = model(batch[:, :-1], batch[:, 1:])
    loss.backward()
    if ours:
        model.finish_gradient_sync()
    opt.step()
    return loss.item()


def compare_with_ddp(rank: int, world: int, pairs: int, bucket_mb: float) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    cfg = RunConfig()
    t = cfg.train
    mesh = Mesh.build(dp=world)
    ours = DataParallel(build_model(cfg), mesh.group("dp"), bucket_mb=bucket_mb)
    peer = DistributedDataParallel(
        build_model(cfg), bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True
    )
    betas = (t.beta1, t.beta2)
    ours_opt = adamw(ours.module, t.lr, t.weight_decay, betas)
    peer_opt = adamw(peer.module, t.lr, t.weight_decay, betas)
    sampler = BatchSampler(load_tokens("").train, t.seq_len, t.global_batch, t.seed)
    per_rank = t.global_batch // world
    batches = [
        sampler.global_batch_at(s)[rank * per_rank : (rank + 1) * per_rank]
        for s in range(pairs + 1)
    ]
    (
        step_pair_side(ours, ours_opt, batches[0], True),
        step_pair_side(peer, peer_opt, batches[0], False),
    )  # warm-up
    rows = []
    for i, batch in enumerate(batches[1:]):
        order = [True, False] if i % 2 == 0 else [False, True]
        times, losses = {}, {}
        for is_ours in order:
            start = time.perf_counter()
            losses[is_ours] = step_pair_side(
                ours if is_ours else peer, ours_opt if is_ours else peer_opt, batch, is_ours
            )
            times[is_ours] = time.perf_counter() - start
        rows.append((times[True], times[False], losses[True], losses[False]))
    diff = max(
        (a - b).abs().max().item()
        for a, b in zip(ours.module.parameters(), peer.module.parameters(), strict=True)
    )
    return {"rows": rows, "max_param_diff": diff}


def measure_overlap(rank: int, world: int, bucket_mbs: list[float], steps: int) -> list[dict]:
    """How much of the gradient all-reduce time the backward pass hides, per bucket size.

    comm_s: the same buckets all-reduced back to back with nothing else running;
    exposed_s: the wait after backward returns (finish_gradient_sync).
    hidden = 1 - exposed / comm.
    """
    from paratrain import comm

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


def sync_vs_async(rank: int, world: int, steps: int, straggler: str, mode: str) -> dict | None:
    from paratrain.train.loop import train

    cfg = RunConfig()
    cfg.parallel.dp, cfg.parallel.dp_mode, cfg.parallel.straggler = world, mode, straggler
    cfg.train.steps, cfg.train.warmup_steps, cfg.train.val_batches = steps, 5, 8
    cfg.train.micro_batch = 4
    start = time.perf_counter()
    result = train(cfg, Mesh.build(dp=world), load_tokens(""))
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


def run_dp_bench(pairs: int = 20, bucket_mb: float = 25.0, async_steps: int = 40) -> dict:
    torch.set_num_threads(1)
    log.info(
        "peer: torch DistributedDataParallel(gradient_as_bucket_view=True, "
        "bucket_cap_mb=%s), AdamW(foreach=True), gloo, %d ranks, 1 thread each",
        bucket_mb,
        WORLD,
    )
    results = run_ranks(compare_with_ddp, WORLD, pairs, bucket_mb, timeout=1800)
    rows, diff = results[0]["rows"], max(r["max_param_diff"] for r in results)
    for _ours_t, _peer_t, ours_loss, peer_loss in rows:
        if abs(ours_loss - peer_loss) > LOSS_RTOL * abs(peer_loss):
            raise RuntimeError(f"losses differ ({ours_loss} vs {peer_loss}): runs not comparable")
    ratios = sorted(o / p for o, p, _, _ in rows)
    quartiles = statistics.quantiles(ratios, n=4)
    summary = {
        "ours_step_s": statistics.median(r[0] for r in rows),
        "torch_step_s": statistics.median(r[1] for r in rows),
        "ratio": statistics.median(ratios),
        "ratio_min": ratios[0],
        "ratio_q1": quartiles[0],
        "ratio_q3": quartiles[2],
        "ratio_max": ratios[-1],
        "pairs": len(rows),
        "max_param_diff": diff,
    }
    log.info(
        "median step: ours %.4f s, DDP %.4f s; ratio median %.3f (IQR %.3f-%.3f, "
        "range %.3f-%.3f) over %d pairs; max parameter difference %.2e",
        summary["ours_step_s"],
        summary["torch_step_s"],
        summary["ratio"],
        quartiles[0],
        quartiles[2],
        ratios[0],
        ratios[-1],
        len(rows),
        diff,
    )
    overlap = run_ranks(measure_overlap, WORLD, [0.25, 1.0, 2.0, 0.0], 10, timeout=1800)[0]
    for o in overlap:
        label = "one bucket" if o["bucket_mb"] == 0 else f"{o['bucket_mb']} MiB"
        log.info(
            "overlap, %s (%d buckets): all-reduce alone %.2f ms, exposed after backward "
            "%.2f ms, hidden %.0f%%",
            label,
            o["buckets"],
            1e3 * o["comm_s"],
            1e3 * o["exposed_s"],
            100 * o["hidden_fraction"],
        )
    straggling = []
    for mode, world in (("sync", 2), ("async", 3)):
        # async: rank 0 serves, ranks 1 and 2 work; rank `world - 1` is 3x slower in both
        run = run_ranks(sync_vs_async, world, async_steps, f"{world - 1}:3", mode, timeout=1800)
        straggling.append(run[0])
        log.info(
            "%s with a 3x straggler: %.1f samples/s, final loss %.3f, val %.3f%s",
            mode,
            run[0]["samples_per_s"],
            run[0]["final_loss"],
            run[0]["val_loss"],
            f", staleness {run[0]['staleness_histogram']}" if mode == "async" else "",
        )
    return {**summary, "overlap": overlap, "straggler": straggling}
