"""`paratrain bench zero`: each ZeRO stage against its PyTorch-native peer on the same GPT.

Ours: the engine `paratrain train --zero s` builds in float32 (stage 0: plain
`DataParallel`; 1 and 2: `ZeroDataParallel`; 3: `FullyShardedDataParallel` over the GPT's
units) and the one `train_step`. Peers (peer.py: PEERS): DDP for stage 0, DDP +
`ZeroRedundancyOptimizer` for 1, FSDP2 `fully_shard(reshard_after_forward=False)` for 2,
FSDP2 `fully_shard` per block then the root for 3, each stepped by `torch_step`; the
HSDP row ("hsdp") is our ZeRO-3 in HSDP_REPLICAS replica groups (`--replicas`) against
FSDP2 `fully_shard` on a 2-D device mesh (replicate, shard) (at dp 2 each replica group is
one rank on both sides: the gradient is all-reduced, nothing is sharded). Both
sides start from the same full GPT (same seed on every rank), take the same batches (each
rank its 1/dp of the global batch), clip at the same global gradient norm and run AdamW
at a constant learning rate with decay on matrices only, in float32, on gloo ranks with
one thread each and the same timer (compare.py).

Per stage: two untimed warm-up steps of each side, then `pairs` pairs, one step of each,
alternating which goes first, then one untimed step of each whose bytes are counted (ours
by our ledger, the peer's at the dispatcher, its gradient norm apart). The report
(report.py) gives both medians, the median of the pairwise ratios (ours / torch) with
their quartiles, the largest parameter difference at the end (both models gathered whole),
the bytes sent per rank in that step against the paper's volume plus our step's
bookkeeping scalars, and the model-state bytes per rank of both at the step boundary
against the planner's closed form (formulas.py). The bench fails if any step's losses
differ by more than LOSS_RTOL (ours: the global mean; the peer's: the mean over ranks).
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch

from paratrain.bench.harness.sides import norm_only
from paratrain.bench.zero.compare import DTYPE, WARMUP, compare_stage
from paratrain.bench.zero.peer import PEERS
from paratrain.bench.zero.report import log_summary, plot_state_bytes, summarize
from paratrain.config import RunConfig
from paratrain.data.tokens import BatchSampler, load_tokens
from paratrain.spawn import run_ranks
from paratrain.train.build import build_model

log = logging.getLogger(__name__)
DP = 2  # on 2 cores only 2-rank timings mean anything
HSDP = "hsdp"  # the row of ZeRO-3 in replica groups against FSDP2's HSDP
HSDP_REPLICAS = 2
STAGES = (0, 1, 2, 3, HSDP)


def _stage_config(cfg: RunConfig, stage: int | str, dp: int) -> RunConfig:
    """The run configuration of one row: a ZeRO stage, or ZeRO-3 in replica groups."""
    cfg = copy.deepcopy(cfg)
    zero, replicas = (3, HSDP_REPLICAS) if isinstance(stage, str) else (stage, 1)  # HSDP
    if dp % replicas:
        raise ValueError(f"the {HSDP} row needs dp divisible by {replicas}; got --dp {dp}")
    p = cfg.parallel
    p.dp, p.zero, p.replicas, cfg.train.dtype = dp, zero, replicas, DTYPE
    return cfg


def run_zero_comparisons(
    pairs: int,
    stages: list[int | str],
    cfg: RunConfig,
    tokens: torch.Tensor,
    dp: int = DP,
) -> list[dict[str, Any]]:
    """Each stage's comparison at dp ranks, summarised (report.py)."""
    t = cfg.train
    if t.global_batch % dp:
        raise ValueError(f"global batch {t.global_batch} does not split over dp {dp}")
    sampler = BatchSampler(tokens, t.seq_len, t.global_batch, t.seed)
    global_batches = [sampler.global_batch_at(s) for s in range(WARMUP + pairs + 1)]
    n_params = sum(p.numel() for p in build_model(cfg).parameters() if p.requires_grad)
    out = []
    for stage in stages:
        stage_cfg = _stage_config(cfg, stage, dp)
        zero, replicas = stage_cfg.parallel.zero, stage_cfg.parallel.replicas
        results = run_ranks(compare_stage, dp, zero, global_batches, stage_cfg, timeout=1800)
        out.append(summarize(zero, dp, results, n_params, replicas))
    return out


def parse_stages(text: str) -> list[int | str]:
    """'0,1,2,3,hsdp' -> [0, 1, 2, 3, 'hsdp']; a ValueError naming the valid ones otherwise."""
    words = [s.strip() for s in text.split(",") if s.strip()]
    try:
        stages: list[int | str] = [w if w == HSDP else int(w) for w in words]
    except ValueError:
        stages = [-1]
    if not stages or any(s not in STAGES for s in stages):
        raise ValueError(f"--stages {text!r}; valid: comma-separated from {STAGES}")
    return stages


def run_zero_bench(
    pairs: int = 20,
    stages: list[int | str] | None = None,
    out: str | None = None,
    dp: int = DP,
    cfg: RunConfig | None = None,
    tokens: torch.Tensor | None = None,
) -> dict:
    """The whole bench: logs each stage's peer and results, writes the PNG, returns
    {"stages": [one entry per stage], "png": path or None}."""
    torch.set_num_threads(1)
    stages = list(STAGES) if stages is None else stages
    cfg = norm_only(cfg or RunConfig())
    for stage in stages:
        log.info(
            "stage %s peer: torch %s; clip_grad_norm_(foreach=True) at %g; gloo, %d ranks, "
            "1 thread each, %s",
            stage, PEERS[stage], cfg.train.grad_clip, dp, DTYPE,
        )  # fmt: skip
    tokens = load_tokens("").train if tokens is None else tokens
    entries = run_zero_comparisons(pairs, stages, cfg, tokens, dp)
    for e in entries:
        log_summary(e)
    if out:
        plot_state_bytes(entries, out)
        log.info("model-state bytes per rank, measured beside the formula: %s", out)
    return {"stages": entries, "png": out or None}
