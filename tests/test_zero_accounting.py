"""Measured model-state bytes and bytes sent per step, against the closed forms.

Memory, as the runtime reports it (what `paratrain train --json` prints): kind by kind and
padding apart, which the allocator cannot tell apart (tests/test_zero_allocator.py proves
the totals by what the allocator holds). Each rank's `memory_report` counts every storage
reachable from the model, the wrapper and the optimizer once, at the step boundary;
params, grads, master and optimizer
must equal `plan.memory.model_state_bytes` to the byte (float32: 16N, 8N + 8N/k,
4N + 12N/k, 16N/k; mixed: 16N, 4N + 12N/k, 2N + 14N/k, 16N/k), with AdamW's step counters
reported as `other` and extra padding as `padding`. Between the micro-batches of a step,
ZeRO-2 holds only its gradient shard by default, and the whole gradient besides with
accumulate "full" (the planner's `grad_accumulation`).

Traffic: the ledger's bytes sent per optimizer step against the ZeRO paper's analysis
(arXiv:1910.02054, section 7): reduce-scatter of gradients (k-1)S/k plus all-gather of
parameters (k-1)S/k for stages 1 and 2 (DDP's 2(k-1)S/k, not half of it as the seeds
say), and for stage 3 two gathers and a reduce-scatter, 3(k-1)S/k, per micro-batch.
ZeRO-2's default reduce-scatters after each of the K micro-batches: K (k-1)S/k.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from paratrain import comm
from paratrain.data.tokens import BatchSampler
from paratrain.mesh import Mesh
from paratrain.models.gpt import count_parameters
from paratrain.parallel.data_parallel.fsdp import FullyShardedDataParallel
from paratrain.parallel.data_parallel.zero import ZeroDataParallel
from paratrain.plan.layout import PRECISIONS, Layout, Workload
from paratrain.plan.memory import model_state_bytes
from paratrain.train.build import build_model
from paratrain.train.engine import FlatEngine
from paratrain.train.step import train_step
from tests.distributed import run_distributed
from tests.equivalence import tiny_config, tiny_data
from tests.test_zero_equivalence import wrap

PLANNER_PRECISION = {"float32": "fp32", "bfloat16": "mixed"}


def measure(rank, world_size, cases, data):
    """Per case: the memory report after two steps, and the second step's ledger totals.

    A case may route every collective through our ring algorithms (algo "ring").
    """
    mesh = Mesh.build(dp=world_size)
    out = []
    for stage, dtype, micro, opts, algo in cases:
        native = mesh.group("dp")
        dp = comm.CommGroup(
            "dp",
            native.pg,
            native.ranks,
            native.global_rank,
            mesh.ledger,
            comm.CommOptions(algo=algo),
        )
        cfg = tiny_config(micro_batch=micro)
        t = cfg.train
        model = wrap(build_model(cfg), dp, stage, dtype, **opts)
        engine = FlatEngine(model)
        opt = engine.build_optimizer(1e-3, t.weight_decay, (t.beta1, t.beta2))
        sampler = BatchSampler(data.train, t.seq_len, t.global_batch, t.seed)
        for step in range(2):
            if step == 1:
                mesh.ledger.reset()
            micro_batches = sampler.replica_microbatches(step, dp.rank, dp.size, micro)
            train_step(engine, opt, micro_batches, 1e-3, 1.0)
        sent = {op: tot.bytes_sent for (_, op), tot in mesh.ledger.totals().items()}
        report = model.memory_report(opt.optimizers[0]).as_dict()
        out.append((report, sent, count_parameters(model.module)))
    padded = [odd_report(dp, stage) for stage in (1, 3)] if world_size == 4 else []
    return out, padded


def planner_bytes(n: int, k: int, stage: int, dtype: str) -> dict[str, int]:
    workload = Workload(precision=PRECISIONS[PLANNER_PRECISION[dtype]])
    return model_state_bytes(n, workload, Layout(dp=k, zero=stage)).as_dict()


@pytest.mark.parametrize("world_size", [2, 4])
def test_model_state_bytes_equal_the_planner_and_traffic_the_zero_paper(world_size):
    """One multi-process run per k: every stage, fp32 and bf16, K = 1 and 2, ring too
    (k = 2), and a model that needs padding (k = 4)."""
    k = world_size
    per_replica = 8 // k
    cases = [
        (stage, dtype, micro, {}, "native")
        for dtype in ("float32", "bfloat16")
        for stage in (0, 1, 2, 3)
        for micro in (per_replica, per_replica // 2)
        if dtype == "float32" or micro == per_replica  # bf16 is slow: no accumulation
    ]
    cases.append((2, "float32", per_replica // 2, {"accumulate": "full"}, "native"))
    if k == 2:  # the same counts when every collective runs our ring algorithm
        cases += [(s, "float32", 2, {}, "ring") for s in (1, 2)]
        cases.append((3, "float32", 2, {"prefetch": 2}, "ring"))
    results = run_distributed(measure, k, cases, tiny_data())
    for rank, (rank_results, padded) in enumerate(results):
        for case, (memory, sent, n) in zip(cases, rank_results, strict=True):
            stage, dtype, micro, opts, algo = case
            label = f"rank {rank} stage {stage} {dtype} micro {micro} {opts} {algo}"
            formula = planner_bytes(n, k, stage, dtype)
            for kind in ("params", "grads", "master", "optimizer"):
                assert memory[kind] == formula[kind], (label, kind, memory, formula)
            assert memory["padding"] == 0, label  # tiny GPT: k divides every unit
            assert memory["other"] <= 4 * 64, label  # AdamW's step counters only
            check_traffic(label, sent, stage, opts, n, k, per_replica // micro, dtype)
        if k == 4:
            check_padding(padded)


def check_traffic(label, sent, stage, opts, n, k, micro_batches, dtype) -> None:
    """Exact bytes of the big collectives; the small all-reduces (loss and token sums,
    the squared norms of the shards: 32 bytes at most) are bounded, not matched."""
    grads = 4 * n  # reduced in fp32, the default reduce dtype
    params = (2 if dtype == "bfloat16" else 4) * n
    if stage == 0:
        big = {"all_reduce": 2 * (k - 1) * grads // k}
    elif stage in (1, 2):
        # ZeRO-2 reduce-scatters every micro-batch unless it accumulates the whole gradient
        per_micro_batch = stage == 2 and opts.get("accumulate", "shard") == "shard"
        rounds = micro_batches if per_micro_batch else 1
        big = {"reduce_scatter": rounds * (k - 1) * grads // k, "all_gather": (k - 1) * params // k}
    else:
        big = {
            "reduce_scatter": micro_batches * (k - 1) * grads // k,
            "all_gather": micro_batches * 2 * (k - 1) * params // k,
        }
    small = sent.get("all_reduce", 0) - big.get("all_reduce", 0)
    assert 0 < small <= 2 * 32, (label, sent, big)
    for op, value in big.items():
        if op != "all_reduce":
            assert sent[op] == value, (label, op, sent, big)
    assert set(sent) == {"all_reduce", *big}, (label, sent)


def held_between_micro_batches(rank, world_size, data):
    """ZeRO-2, K = 2: what the wrapper holds once micro-batch 1's backward has returned
    (before micro-batch 2 runs), and after the step's sync; default accumulation, then
    "full". bucket_mb 0.05: several buckets, so some are reduced during the backward."""
    dp = Mesh.build(dp=world_size).group("dp")
    cfg = tiny_config(micro_batch=2)
    t = cfg.train
    first, second = BatchSampler(
        data.train, t.seq_len, t.global_batch, t.seed
    ).replica_microbatches(0, dp.rank, dp.size, 2)
    out = []
    for opts in ({}, {"accumulate": "full"}):
        model = wrap(build_model(cfg), dp, 2, bucket_mb=0.05, **opts)
        with model.no_sync():
            model(first[:, :-1], first[:, 1:]).backward()
        between = model.memory_report().as_dict()
        model(second[:, :-1], second[:, 1:]).backward()
        model.finish_gradient_sync()
        out.append((between, model.memory_report().as_dict(), count_parameters(model.module)))
    return out


def test_zero2_default_holds_only_the_shard_between_micro_batches():
    """Issue 17: by default ZeRO-2 reduce-scatters each micro-batch's gradient into the
    shard before that backward returns, so while accumulating it holds N/k gradients
    (fp32: 4N/k bytes), the planner's ZeRO-2 row; with accumulate "full" the buckets also
    hold the whole gradient, 4N, the planner's `grad_accumulation`. Measured by the
    wrapper's memory report (every storage reachable from it, once), on each rank, against
    the planner's numbers for the default workload and for full."""
    k, micro_batches = 2, 2
    workloads = {
        "default": Workload(precision=PRECISIONS["fp32"]),
        "full": Workload(precision=PRECISIONS["fp32"], zero2_accumulate="full"),
    }
    for rank_results in run_distributed(held_between_micro_batches, k, tiny_data()):
        for option, (between, after, n) in zip(workloads, rank_results, strict=True):
            planned = model_state_bytes(n, workloads[option], Layout(dp=k, zero=2), micro_batches)
            whole = 4 * n if option == "full" else 0
            assert after["grads"] == planned.grads == 4 * n // k, (option, after)
            assert between["grads"] == 4 * n // k + whole, (option, between)
            assert between["grads"] == planned.grads + planned.grad_accumulation, option


class Odd(nn.Module):
    """Parameter counts that k = 2 and 4 do not divide: shards need padding."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 3)  # 18
        self.b = nn.Linear(3, 7, bias=False)  # 21

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.b(torch.tanh(self.a(x))), y)


def odd_report(group, stage) -> dict[str, int]:
    torch.manual_seed(0)
    if stage == 3:
        model = FullyShardedDataParallel(Odd(), group, [["a"], ["b"]])
    else:
        model = ZeroDataParallel(Odd(), group, stage)
    opt = model.build_optimizer(1e-2, 0.1, (0.9, 0.95))
    x, y = torch.randn(4, 5), torch.randint(0, 7, (4,))
    model(x, y).backward()
    model.finish_gradient_sync()
    opt.step()
    return model.memory_report(opt).as_dict()


def check_padding(padded: list[dict[str, int]]) -> None:
    """n = 39 over k = 4: ZeRO-1 pads one buffer to 40; ZeRO-3 pads each unit (20 + 24)."""
    for stage, report in zip((1, 3), padded, strict=True):
        formula = planner_bytes(39, 4, stage, "float32")
        if stage == 1:  # the full flat buffers of params and grads: one element each
            assert report["padding"] == 4 + 4
        else:  # shards of 5 + 6 = 11 elements instead of ceil(39 / 4) = 10, 16 bytes each
            assert report["padding"] == 16 * (11 - 10)
        for kind in ("params", "grads", "master", "optimizer"):
            assert report[kind] == formula[kind], (kind, report, formula)
