"""`paratrain bench pp`: our pipeline schedules against `torch.distributed.pipelining`.

For each schedule, 2 gloo ranks (1 thread each; on 2 cores only 2-rank timings mean
anything) run our pipeline engine with the one `train_step` and torch's schedule class on
copies of the same GPT with the same split, micro-batch count, batches and clipping,
alternating which goes first for `pairs` pairs (compare.py; the peer in peer.py).
Reported per schedule: the medians of both step times, the median of the pairwise ratios
ours / torch with quartiles and range, our measured bubble (per stage, from the runtime's
own timestamps, median over pairs) beside the simulated one and the formula, and our peak
in-flight activations per stage. The bench fails if the two
sides' losses differ by more than LOSS_RTOL at any step: then the runs are not comparable
(report.py).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from paratrain.bench.pp.compare import compare_schedules
from paratrain.bench.pp.peer import PEER
from paratrain.bench.pp.report import LOSS_RTOL, draw, log_entry, schedules_table, summarise
from paratrain.config import RunConfig
from paratrain.data.tokens import BatchSampler, load_tokens
from paratrain.parallel.pipeline import build_schedule
from paratrain.spawn import run_ranks

log = logging.getLogger(__name__)
WORLD = 2
MICRO_BATCH = 2  # sequences per micro-batch: K = 8 gives the default global batch of 16


def peer_description(name: str, k: int) -> str:
    cls, v = PEER[name]
    stage = f"PipelineStage(chunk, stage_index=c*{WORLD}+rank, num_stages={WORLD * v})"
    return (
        f"torch.distributed.pipelining.{cls}({stage} x{v}, n_microbatches={k}, "
        "loss_fn=mean cross-entropy, scale_grads=True), step(return_outputs=False); "
        "get_total_norm(foreach=True) squared and all-reduced over the stages, not "
        "clipped by (as ours: bench/harness/sides.py norm_only); "
        f"AdamW(foreach=True); gloo, {WORLD} ranks, 1 thread each"
    )


def _check_args(names: list[str], pairs: int, k: int) -> None:
    unknown = [n for n in names if n not in PEER]
    if unknown or not names:
        raise ValueError(f"--schedules {','.join(names)!r}; valid: {', '.join(PEER)}")
    if pairs < 2:
        raise ValueError(f"--pairs {pairs}: need at least 2 pairs for quartiles")
    for name in names:
        build_schedule(name, WORLD, k, PEER[name][1])  # K valid for every schedule asked


def _batches(count: int, k: int, data: str) -> list[torch.Tensor]:
    """The first `count` global batches of `data` ('' = the default corpus), K x b rows."""
    t = RunConfig().train
    sampler = BatchSampler(load_tokens(data).train, t.seq_len, k * MICRO_BATCH, t.seed)
    return [sampler.global_batch_at(step) for step in range(count)]


def run_pp_bench(
    names: list[str],
    pairs: int = 20,
    microbatches: int = 8,
    out: str | None = "runs/bench-pp",
    data: str = "",
    compile: bool = False,
) -> dict[str, Any]:
    """Run every schedule in `names` against torch's; the result of `--json`.

    The batches are read once here and handed to the ranks, so both sides and all stages
    see the same ones; `data` is `load_tokens`'s path (tests pass a small file to skip
    reading the default corpus).
    """
    _check_args(names, pairs, microbatches)
    if compile and "zb-h1" in names:
        raise ValueError(
            "--compile with zb-h1: a compiled block's backward computes input and weight "
            "gradients together; use --schedules gpipe,1f1b,interleaved"
        )
    torch.set_num_threads(1)
    batches = _batches(pairs + 1, microbatches, data)
    for name in names:
        log.info("%s vs %s", name, peer_description(name, microbatches))
    if compile:
        log.info("both sides: each block compiled (torch.compile, inductor); warm-up compiles")
    by_rank = run_ranks(
        compare_schedules, WORLD, names, batches, microbatches, compile, timeout=3600
    )
    results = []
    for name in names:
        per_rank = [r[name] for r in by_rank]
        entry = summarise(name, microbatches, per_rank)
        if out:
            draw(entry, per_rank, Path(out))
        results.append(entry)
        log_entry(entry)
    log.info(schedules_table(results))
    return {"schedules": results, "loss_rtol": LOSS_RTOL, "world_size": WORLD}
