"""`paratrain bench dp`: our DataParallel against torch DistributedDataParallel, overlap, and
sync against async data parallelism under a straggler.

Against DDP (compare.py): our engine and `train_step` against
`DistributedDataParallel(gradient_as_bucket_view=True)` with our buckets, its
documented fast configuration, on a copy of the same model with the same initial weights,
the same batches, the global gradient norm on both sides (not clipped: sides.norm_only),
AdamW(foreach=True), one thread per rank and the same timer. Each pair runs one step of
each, alternating which goes first; the report gives both medians, the median and spread
of the pairwise ratios, and the largest parameter difference at the end. The bench fails
if our loss (the global mean) and the mean of the peer's per-rank losses differ by more
than LOSS_RTOL at any step. Then the overlap (overlap.py) and the straggler runs
(sync_vs_async.py).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from paratrain.bench.dp.compare import compare_with_ddp
from paratrain.bench.dp.overlap import run_overlap
from paratrain.bench.dp.sync_vs_async import run_straggler
from paratrain.bench.harness.ddp_pairs import ddp_buckets
from paratrain.bench.harness.pairs import check_mean_losses, ratio_summary
from paratrain.bench.harness.sides import norm_only
from paratrain.config import RunConfig
from paratrain.data.tokens import BatchSampler, load_tokens
from paratrain.spawn import run_ranks

log = logging.getLogger(__name__)
LOSS_RTOL = 1e-4  # per step, ours vs the peers' mean: reordered float32 sums (harness/pairs.py)
WORLD = 2  # on 2 cores only 2-rank timings mean anything
PEER = (
    "DistributedDataParallel(gradient_as_bucket_view=True, {}), "
    "clip_grad_norm_(foreach=True) at {}, AdamW(foreach=True)"
)


def run_dp_bench(
    pairs: int = 20, bucket_mb: float = 25.0, async_steps: int = 40, cfg: RunConfig | None = None
) -> dict:
    """With cfg.train.compile, the comparison with DDP compiles both sides' blocks; the
    overlap and straggler parts measure our uncompiled runs."""
    summary = compare_ddp(pairs, bucket_mb, cfg)
    overlap = run_overlap(WORLD)
    straggling = run_straggler(async_steps)
    return {**summary, "overlap": overlap, "straggler": straggling}


def compare_ddp(
    pairs: int,
    bucket_mb: float,
    cfg: RunConfig | None = None,
    tokens: torch.Tensor | None = None,
) -> dict[str, Any]:
    """Ours against DDP on WORLD ranks, logged; raises RuntimeError if the losses differ."""
    torch.set_num_threads(1)
    cfg = norm_only(cfg or RunConfig())
    t, p = cfg.train, cfg.parallel
    p.dp, p.bucket_mb = WORLD, bucket_mb
    buckets = ", ".join(f"{k}={v}" for k, v in ddp_buckets(bucket_mb).items())
    peer = PEER.format(buckets, t.grad_clip) + (", blocks compiled" if t.compile else "")
    log.info("peer: torch %s; gloo, %d ranks, 1 thread each", peer, WORLD)
    tokens = load_tokens("").train if tokens is None else tokens
    sampler = BatchSampler(tokens, t.seq_len, t.global_batch, t.seed)
    global_batches = [sampler.global_batch_at(s) for s in range(pairs + 1)]
    results = run_ranks(compare_with_ddp, WORLD, global_batches, cfg, timeout=1800)
    worst = check_mean_losses([r["losses"] for r in results], LOSS_RTOL)
    rows = results[0]["rows"]  # rank 0's clock; both ranks wait on the same collectives
    summary = {
        **ratio_summary([r.ours_s for r in rows], [r.peer_s for r in rows]),
        "max_param_diff": max(r["max_param_diff"] for r in results),
        "max_loss_rel_diff": worst,
        "peer": peer,
    }
    log.info(
        "median step: ours %.4f s, DDP %.4f s; ratio median %.3f (IQR %.3f-%.3f, "
        "range %.3f-%.3f) over %d pairs; losses within %.1e; max parameter difference %.2e",
        summary["ours_step_s"], summary["torch_step_s"], summary["ratio"],
        summary["ratio_q1"], summary["ratio_q3"], summary["ratio_min"], summary["ratio_max"],
        summary["pairs"], worst, summary["max_param_diff"],
    )  # fmt: skip
    return summary
