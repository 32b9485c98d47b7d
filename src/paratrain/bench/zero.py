"""`paratrain bench zero`: our ZeRO-1, -2 and -3 against PyTorch's own sharded training.

Ours: `ZeroDataParallel(stage=1 or 2)` and `FullyShardedDataParallel(gpt_units, prefetch=1)`
(ZeRO-3), each with its `ShardedAdamW`. Peers (`bench/zero_peer.py`): DDP with
`ZeroRedundancyOptimizer(AdamW)` for stages 1 and 2, FSDP2 `fully_shard` per block and
then the root for stage 3. Both sides start from the same full GPT (same seed on every
rank), take the same batches (each rank its half of the global batch), average gradients
over the 2 ranks, and run AdamW at a constant learning rate with decay on matrices only,
in float32, on 2 gloo ranks with one thread each and the same timer. No clipping.

Per comparison, each pair runs one step of each, alternating which goes first; the report
gives both medians, the median of the pairwise ratios (ours / torch) with their spread, the
largest parameter difference at the end (both models gathered whole), and the model-state
bytes per rank of both at the step boundary (after `step()`), against the planner's
closed form for fp32 Adam (`plan/memory.py: model_state_bytes`, no master copy):
16N (DP), 8N + 8N/k (ZeRO-1), 4N + 12N/k (ZeRO-2), 16N/k (ZeRO-3). The bench fails if the
two loss curves differ anywhere by more than LOSS_RTOL (relative).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from paratrain.bench import zero_peer
from paratrain.bench.dp import step_pair_side
from paratrain.bench.ranks import run_ranks
from paratrain.config import RunConfig
from paratrain.mesh import Mesh
from paratrain.parallel.fsdp import FullyShardedDataParallel, gpt_units
from paratrain.parallel.zero import ZeroDataParallel
from paratrain.plan.layout import PRECISIONS, Layout, Workload
from paratrain.plan.memory import model_state_bytes
from paratrain.train.data import BatchSampler, load_tokens
from paratrain.train.loop import build_model

log = logging.getLogger(__name__)
LOSS_RTOL = 1e-4  # relative difference of the two losses allowed at every step, every rank
WORLD = 2  # on 2 cores only 2-rank timings mean anything


@dataclass(frozen=True)
class Variant:
    name: str
    zero: int
    peer: str


DDP_ZERO = "DDP(gradient_as_bucket_view=True) + ZeroRedundancyOptimizer(AdamW)"
VARIANTS = {
    "zero1": Variant("zero1", 1, DDP_ZERO),
    "zero2": Variant("zero2", 2, DDP_ZERO),
    "zero3": Variant("zero3", 3, "FSDP2 fully_shard per block, then the root"),
}


def _build(
    cfg: RunConfig, zero: int, world: int, ours: bool
) -> tuple[nn.Module, torch.optim.Optimizer | Any]:
    t = cfg.train
    module, betas = build_model(cfg), (t.beta1, t.beta2)
    if not ours:
        if zero == 3:
            return zero_peer.wrap_fsdp2(module, world, t.lr, t.weight_decay, betas)
        return zero_peer.wrap_ddp_zero(module, t.lr, t.weight_decay, betas)
    group = Mesh.build(dp=world).group("dp")
    if zero == 3:
        model = FullyShardedDataParallel(module, group, gpt_units(module), reduce_op="avg")
    else:
        model = ZeroDataParallel(module, group, stage=zero, reduce_op="avg")
    return model, model.build_optimizer(t.lr, t.weight_decay, betas)


def _full_params(model: nn.Module, ours: bool) -> dict[str, torch.Tensor]:
    """Every parameter whole on every rank (collectives: same order on all ranks)."""
    from torch.distributed.tensor import DTensor

    if ours:
        return model.full_state_dict()
    module = getattr(model, "module", model)  # DDP wraps, FSDP2 does not
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
        for n, p in module.named_parameters()
    }


def compare_variant(
    rank: int, world: int, zero: int, global_batches: list[torch.Tensor], cfg: RunConfig
) -> dict[str, Any]:
    """One rank of one comparison: per-pair times and losses, bytes, final difference."""
    per_rank = global_batches[0].shape[0] // world
    batches = [b[rank * per_rank : (rank + 1) * per_rank] for b in global_batches]
    ours, ours_opt = _build(cfg, zero, world, True)
    peer, peer_opt = _build(cfg, zero, world, False)
    (
        step_pair_side(ours, ours_opt, batches[0], True),
        step_pair_side(peer, peer_opt, batches[0], False),
    )  # warm-up
    rows = []
    for i, batch in enumerate(batches[1:]):
        order = (True, False) if i % 2 == 0 else (False, True)
        times, losses = {}, {}
        for is_ours in order:
            model, opt = (ours, ours_opt) if is_ours else (peer, peer_opt)
            start = time.perf_counter()
            losses[is_ours] = step_pair_side(model, opt, batch, is_ours)
            times[is_ours] = time.perf_counter() - start
        rows.append((times[True], times[False], losses[True], losses[False]))
    ours_bytes = ours.memory_report(ours_opt).as_dict()
    ours_bytes.pop("total")
    peer_bytes = zero_peer.peer_state_bytes(peer, peer_opt)
    a, b = _full_params(ours, True), _full_params(peer, False)
    diff = max((a[n] - b[n]).abs().max().item() for n in b)
    return {"rows": rows, "ours_bytes": ours_bytes, "torch_bytes": peer_bytes, "diff": diff}


def predicted_state(n_params: int, zero: int, world: int) -> dict[str, int]:
    """The planner's model-state bytes per rank for fp32 AdamW (no master copy)."""
    workload = Workload(precision=PRECISIONS["fp32"], optimizer="adam")
    return model_state_bytes(n_params, workload, Layout(dp=world, zero=zero)).as_dict()


def run_zero_comparisons(
    pairs: int, variants: list[str], cfg: RunConfig, tokens: torch.Tensor
) -> list[dict[str, Any]]:
    """Each variant's comparison at WORLD ranks, summarised (bench/zero_report.py)."""
    from paratrain.bench.zero_report import summarize

    t = cfg.train
    sampler = BatchSampler(tokens, t.seq_len, t.global_batch, t.seed)
    global_batches = [sampler.global_batch_at(s) for s in range(pairs + 1)]
    n_params = sum(p.numel() for p in build_model(cfg).parameters() if p.requires_grad)
    out = []
    for name in variants:
        v = VARIANTS[name]
        results = run_ranks(compare_variant, WORLD, v.zero, global_batches, cfg, timeout=1800)
        predicted = predicted_state(n_params, v.zero, WORLD)
        out.append(summarize(v, results, n_params, predicted))
    return out


def run_zero_bench(
    pairs: int = 20, variants: list[str] | None = None, out: str | None = None
) -> dict:
    from paratrain.bench.zero_report import log_summary, plot_state_bytes

    torch.set_num_threads(1)
    names = variants or list(VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise ValueError(f"variants {unknown}; valid: {', '.join(VARIANTS)}")
    for name in names:
        log.info(
            "%s peer: torch %s; gloo, %d ranks, 1 thread each, float32",
            name,
            VARIANTS[name].peer,
            WORLD,
        )
    entries = run_zero_comparisons(pairs, names, RunConfig(), load_tokens("").train)
    for e in entries:
        log_summary(e)
    if out:
        plot_state_bytes(entries, out)
        log.info("model-state bytes per rank: %s", out)
    return {"comparisons": entries, "png": out or None}
