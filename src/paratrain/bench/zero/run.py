"""`paratrain bench zero`: each ZeRO stage against its PyTorch-native peer on the same GPT.

Ours: the wrapper `train/build.py: data_parallel` picks for `--zero s` in float32 (stage 0: plain
`DataParallel`; 1 and 2: `ZeroDataParallel`; 3: `FullyShardedDataParallel` over the GPT's
units), with its optimizer. Peers (`bench/zero_peer.py: PEERS`): DDP for stage 0, DDP +
`ZeroRedundancyOptimizer` for 1, FSDP2 `fully_shard(reshard_after_forward=False)` for 2,
FSDP2 `fully_shard` per block then the root for 3. Both sides start from the same full
GPT (same seed on every rank), take the same batches (each rank its 1/dp of the global
batch), average gradients, and run AdamW at a constant learning rate with decay on
matrices only, in float32, on gloo ranks with one thread each and the same timer. No
clipping.

Per stage: two untimed warm-up steps of each side, then `pairs` pairs, one step of each,
alternating which goes first, then one untimed step of each whose bytes are counted (ours
by our ledger, the peer's at the dispatcher). The report gives both medians, the median of
the pairwise ratios (ours / torch) with their quartiles, the largest parameter difference
at the end (both models gathered whole), the bytes sent per rank in that step, and the
model-state bytes per rank of both at the step boundary against the planner's closed form
(`plan/memory.py: model_state_bytes`; float32 Adam, no master copy: 16N, 8N + 8N/k,
4N + 12N/k, 16N/k). The bench fails if any step's losses differ by more than LOSS_RTOL.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from typing import Any

import torch
from torch import nn

from paratrain.bench.dp.run import step_pair_side
from paratrain.bench.harness.spawn import run_ranks
from paratrain.bench.zero import peer as zero_peer
from paratrain.config import RunConfig
from paratrain.mesh import Mesh
from paratrain.parallel.replica import Replica
from paratrain.plan.comm import all_reduce_bytes
from paratrain.plan.layout import PRECISIONS, Layout, Workload
from paratrain.plan.memory import model_state_bytes
from paratrain.train.build import build_model, data_parallel
from paratrain.train.data import BatchSampler, load_tokens

log = logging.getLogger(__name__)
LOSS_RTOL = 1e-4  # relative difference of the two losses allowed at every step, every rank
DP = 2  # on 2 cores only 2-rank timings mean anything
STAGES = (0, 1, 2, 3)
WARMUP = 2  # untimed steps of each side before the pairs; one more after them counts bytes
DTYPE = "float32"  # bf16 matmuls are about 50x slower on these CPUs


def formula_state(n_params: int, zero: int, dp: int, dtype: str = DTYPE) -> dict[str, int]:
    """The planner's model-state bytes per rank for AdamW, by kind and `total`.

    float32: no master copy (16N, 8N + 8N/k, 4N + 12N/k, 16N/k); 16-bit: mixed precision
    with fp32 master weights and moments (16N, 4N + 12N/k, 2N + 14N/k, 16N/k).
    """
    precision = PRECISIONS["fp32" if dtype == "float32" else "mixed"]
    workload = Workload(precision=precision, optimizer="adam")
    return model_state_bytes(n_params, workload, Layout(dp=dp, zero=zero)).as_dict()


def formula_comm(n_params: int, zero: int, dp: int) -> int:
    """ZeRO paper section 7 bytes sent per rank per step (float32, ring): 2(k-1)S/k for
    stages 0-2, 3(k-1)S/k for stage 3, S = 4N; sharded stages pad S to k ceil(N/k)
    elements, as the planner does (plan/comm.py)."""
    if zero == 0:
        return all_reduce_bytes(4 * n_params, dp)
    per_pass = (dp - 1) * math.ceil(n_params / dp) * 4  # one reduce-scatter or all-gather
    return (2 if zero < 3 else 3) * per_pass


def _stage_config(cfg: RunConfig, zero: int, dp: int) -> RunConfig:
    cfg = copy.deepcopy(cfg)
    cfg.parallel.dp, cfg.parallel.zero, cfg.train.dtype = dp, zero, DTYPE
    return cfg


def _build_ours(cfg: RunConfig, mesh: Mesh) -> tuple[nn.Module, Any]:
    t = cfg.train
    # Losses are per-rank means, as the peers' are: replicas average.
    model = data_parallel(build_model(cfg), mesh.group("dp"), cfg, reduce_op="avg")
    return model, model.build_optimizer(t.lr, t.weight_decay, (t.beta1, t.beta2))


def _ours_state(model: Replica, optimizer: Any) -> dict[str, int]:
    """Our bytes by kind, from the wrapper's own memory report."""
    report = model.memory_report(optimizer).as_dict()
    report.pop("total")
    return report


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


def _timed_pairs(
    sides: dict[bool, tuple[nn.Module, Any]], batches: list[torch.Tensor]
) -> tuple[list, list]:
    """(ours, torch) seconds and losses per pair; even pairs run ours first, odd torch."""
    times, losses = [], []
    for i, batch in enumerate(batches):
        order = (True, False) if i % 2 == 0 else (False, True)
        took, loss = {}, {}
        for is_ours in order:
            start = time.perf_counter()
            loss[is_ours] = step_pair_side(*sides[is_ours], batch, is_ours)
            took[is_ours] = time.perf_counter() - start
        times.append((took[True], took[False]))
        losses.append((loss[True], loss[False]))
    return times, losses


def compare_stage(
    rank: int, world: int, zero: int, global_batches: list[torch.Tensor], cfg: RunConfig
) -> dict[str, Any]:
    """One rank of one stage's comparison: times, losses, bytes held and sent, difference."""
    per_rank = global_batches[0].shape[0] // world
    batches = [b[rank * per_rank : (rank + 1) * per_rank] for b in global_batches]
    t = cfg.train
    mesh = Mesh.build(dp=world)
    sides = {
        True: _build_ours(cfg, mesh),
        False: zero_peer.wrap_peer(
            zero, build_model(cfg), world, t.lr, t.weight_decay, (t.beta1, t.beta2)
        ),
    }
    losses = [  # warm-up: DDP rebuilds its buckets in its second step
        tuple(step_pair_side(*sides[o], batch, o) for o in (True, False))
        for batch in batches[:WARMUP]
    ]
    times, timed_losses = _timed_pairs(sides, batches[WARMUP:-1])
    mesh.ledger.reset()  # the last step counts the bytes sent (untimed: counting costs)
    ours_loss = step_pair_side(*sides[True], batches[-1], True)
    ours_by_op: dict[str, int] = {}
    for (_, op), totals in mesh.ledger.totals().items():
        ours_by_op[op] = ours_by_op.get(op, 0) + totals.bytes_sent
    with zero_peer.PeerTraffic(world, rank) as traffic:
        counted = (ours_loss, step_pair_side(*sides[False], batches[-1], False))
    a, b = _full_params(sides[True][0], True), _full_params(sides[False][0], False)
    return {
        "times": times,
        "losses": losses + timed_losses + [counted],
        "ours_bytes": _ours_state(*sides[True]),
        "torch_bytes": zero_peer.state_bytes(*sides[False]),
        "ours_sent": ours_by_op,
        "torch_sent": dict(traffic.sent),
        "torch_unsized": dict(traffic.unsized),
        "diff": max((a[n] - b[n]).abs().max().item() for n in b),
    }


def run_zero_comparisons(
    pairs: int,
    stages: list[int],
    cfg: RunConfig,
    tokens: torch.Tensor,
    dp: int = DP,
) -> list[dict[str, Any]]:
    """Each stage's comparison at dp ranks, summarised (bench/zero_report.py)."""
    from paratrain.bench.zero.report import summarize

    t = cfg.train
    if t.global_batch % dp:
        raise ValueError(f"global batch {t.global_batch} does not split over dp {dp}")
    sampler = BatchSampler(tokens, t.seq_len, t.global_batch, t.seed)
    global_batches = [sampler.global_batch_at(s) for s in range(WARMUP + pairs + 1)]
    n_params = sum(p.numel() for p in build_model(cfg).parameters() if p.requires_grad)
    out = []
    for zero in stages:
        stage_cfg = _stage_config(cfg, zero, dp)
        results = run_ranks(compare_stage, dp, zero, global_batches, stage_cfg, timeout=1800)
        formula = formula_state(n_params, zero, dp)
        out.append(
            summarize(zero, dp, results, n_params, formula, formula_comm(n_params, zero, dp))
        )
    return out


def parse_stages(text: str) -> list[int]:
    """'0,1,2,3' -> [0, 1, 2, 3]; a ValueError naming the valid stages otherwise."""
    try:
        stages = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        stages = [-1]
    if not stages or any(s not in STAGES for s in stages):
        raise ValueError(f"--stages {text!r}; valid: comma-separated from {STAGES}")
    return stages


def run_zero_bench(
    pairs: int = 20,
    stages: list[int] | None = None,
    out: str | None = None,
    dp: int = DP,
    cfg: RunConfig | None = None,
    tokens: torch.Tensor | None = None,
) -> dict:
    """The whole bench: logs each stage's peer and results, writes the PNG, returns
    {"stages": [one entry per stage], "png": path or None}."""
    from paratrain.bench.zero.report import log_summary, plot_state_bytes

    torch.set_num_threads(1)
    stages = list(STAGES) if stages is None else stages
    cfg = cfg or RunConfig()
    for zero in stages:
        log.info(
            "stage %d peer: torch %s; gloo, %d ranks, 1 thread each, %s",
            zero,
            zero_peer.PEERS[zero],
            dp,
            DTYPE,
        )
    tokens = load_tokens("").train if tokens is None else tokens
    entries = run_zero_comparisons(pairs, stages, cfg, tokens, dp)
    for e in entries:
        log_summary(e)
    if out:
        plot_state_bytes(entries, out)
        log.info("model-state bytes per rank, measured beside the formula: %s", out)
    return {"stages": entries, "png": out or None}
