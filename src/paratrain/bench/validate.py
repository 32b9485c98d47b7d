"""`paratrain plan --validate`: the planner's predictions against a real run, side by side.

Runs our small GPT here in gloo processes on CPU and compares, per rank, what the planner
predicts with what the run measured:
- model-state bytes, itemised: parameters and gradients from the tensors, optimizer
  moments from the optimizer's state (AdamW's per-tensor `step` counters, 4 bytes per
  parameter tensor, are bookkeeping that neither side counts), fp32 master weights
  (none in fp32 training);
- bytes sent per optimizer step, from the ledger of the comm layer, every step.
Both are deterministic, so they must agree exactly; a mismatch exits non-zero.

Only plain data parallelism exists so far. Each strategy that lands adds a `Case` (its
layout and the run that measures it) to CASES; the comparison and the table are shared.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from paratrain.config import RunConfig
from paratrain.plan import comm as plan_comm
from paratrain.plan.cluster import ClusterSpec
from paratrain.plan.estimate import estimate
from paratrain.plan.layout import PRECISIONS, Layout, Workload
from paratrain.plan.model import ModelSpec

log = logging.getLogger(__name__)
TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Row:
    case: str
    quantity: str
    predicted: float
    measured: float
    exact: bool = True  # deterministic: must be equal
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.predicted == self.measured if self.exact else True


@dataclass(frozen=True)
class Case:
    """One strategy to validate: its layout, and the function each rank runs to measure."""

    name: str
    layout: Layout
    measure: Callable[[RunConfig, int, int], dict[str, Any]]


def small_config(world: int, steps: int) -> RunConfig:
    """Our default GPT, a few short steps: big enough to be a real run, quick on CPU."""
    cfg = RunConfig()
    cfg.parallel.nproc = world
    cfg.parallel.dp = world
    cfg.train.steps = steps
    cfg.train.warmup_steps = 1
    cfg.train.global_batch = 4 * world
    cfg.train.micro_batch = 2
    cfg.train.val_batches = 0
    cfg.train.dtype = "float32"
    cfg.parallel.bucket_mb = 0  # one bucket: one gradient all-reduce, as the planner counts
    return cfg


def model_spec(cfg: RunConfig) -> ModelSpec:
    m = cfg.model
    return ModelSpec(
        "paratrain",
        n_layer=m.n_layer,
        d_model=m.d_model,
        n_head=m.n_head,
        vocab_size=m.vocab_size,
        seq_len=cfg.train.seq_len,
        max_seq_len=m.max_seq_len,
    )


def workload_for(cfg: RunConfig) -> Workload:
    """fp32 AdamW, the CPU runtime's precision; one gradient bucket (one flat all-reduce)."""
    return Workload(
        micro_batch=cfg.train.micro_batch,
        global_batch=cfg.train.global_batch,
        precision=PRECISIONS["fp32"],
        bucket_bytes=2**62,
    )


def measure_dp(cfg: RunConfig, rank: int, world: int) -> dict[str, Any]:
    """Train under data parallelism; return model-state bytes and per-step dp traffic."""
    import torch

    from paratrain.mesh import Mesh
    from paratrain.train import loop
    from paratrain.train.data import TokenData

    mesh = Mesh.build(dp=world)
    dp = mesh.group("dp")
    tokens = torch.randint(
        0, cfg.model.vocab_size, (20_000,), generator=torch.Generator().manual_seed(0)
    )
    data = TokenData(tokens.to(torch.uint8), tokens[:0].to(torch.uint8), 256, "random", "random")
    per_step: list[int] = []

    def on_step(_: Any) -> None:
        sent = mesh.ledger.bytes_sent(group=dp.name, op="all_reduce")
        per_step.append(sent - sum(per_step))

    captured: dict[str, Any] = {}
    real_build = loop.build_adamw

    def build_and_keep(*args: Any, **kwargs: Any) -> torch.optim.Optimizer:
        captured["optimizer"] = real_build(*args, **kwargs)
        return captured["optimizer"]

    loop.build_adamw = build_and_keep  # to read the optimizer's state after training
    try:
        result = loop.train(cfg, mesh, data, on_step=on_step)
    finally:
        loop.build_adamw = real_build
    model, optimizer = result.model, captured["optimizer"]
    moments = sum(
        t.numel() * t.element_size()
        for state in optimizer.state.values()
        for name, t in state.items()
        if name != "step" and torch.is_tensor(t)
    )
    return {
        "params": sum(p.numel() * p.element_size() for p in model.parameters()),
        "grads": sum(p.grad.numel() * p.grad.element_size() for p in model.parameters()),
        "optimizer": moments,
        "master": 0,
        "comm_per_step": per_step,
    }


CASES = [Case("dp", Layout(dp=2), measure_dp)]


def _rank_main(case: Case, cfg: RunConfig, rank: int, world: int, store: str, out: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            store=dist.FileStore(store, world),
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=60),
        )
        try:
            out.put((rank, "ok", case.measure(cfg, rank, world)))
        finally:
            dist.destroy_process_group()
    except BaseException as e:  # reported by the parent, in one line
        out.put((rank, "error", f"{type(e).__name__}: {e}"))


def run_case(case: Case, steps: int = 3) -> list[dict[str, Any]]:
    """Start world gloo processes for one case; each rank's measurements, by rank."""
    world = case.layout.world
    cfg = small_config(world, steps)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="paratrain-validate-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_rank_main, args=(case, cfg, r, world, store, out), daemon=True)
            for r in range(world)
        ]
        for p in procs:
            p.start()
        results: dict[int, dict[str, Any]] = {}
        try:
            while len(results) < world:
                rank, status, value = out.get(timeout=TIMEOUT_S)
                if status != "ok":
                    raise RuntimeError(f"validate {case.name}: rank {rank} failed: {value}")
                results[rank] = value
        except queue.Empty:
            raise RuntimeError(f"validate {case.name}: no result after {TIMEOUT_S} s") from None
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    return [results[r] for r in range(world)]


def compare(case: Case, measured: list[dict[str, Any]], steps: int) -> list[Row]:
    """Rows of predicted against measured, for every rank and every step."""
    cfg = small_config(case.layout.world, steps)
    cluster = ClusterSpec(
        "this machine", case.layout.world, case.layout.world, 1e15, 1, 1, 0, 0, 1, 1
    )
    est = estimate(model_spec(cfg), cluster, workload_for(cfg), case.layout)
    predicted_state = est.model_state.as_dict()
    # The loop also sums (loss, tokens) over dp for token weighting: one all-reduce of two
    # float64 numbers per step.
    loss_bytes = plan_comm.all_reduce_bytes(16, case.layout.dp)
    rows = []
    for rank, m in enumerate(measured):
        for kind in ("params", "grads", "optimizer", "master"):
            rows.append(Row(case.name, f"rank {rank} {kind} bytes", predicted_state[kind], m[kind]))
        for step, sent in enumerate(m["comm_per_step"], start=1):
            rows.append(
                Row(
                    case.name,
                    f"rank {rank} step {step} bytes sent",
                    est.comm_bytes + loss_bytes,
                    sent,
                    note=f"{est.comm_bytes} gradients + {loss_bytes} (loss, tokens)",
                )
            )
    return rows


def format_rows(rows: list[Row]) -> str:
    lines = [f"{'case':<6} {'quantity':<28} {'predicted':>14} {'measured':>14}  ok"]
    for r in rows:
        mark = "yes" if r.ok else "NO"
        lines.append(
            f"{r.case:<6} {r.quantity:<28} {r.predicted:>14,.0f} {r.measured:>14,.0f}  {mark}"
            + (f"  ({r.note})" if r.note else "")
        )
    return "\n".join(lines)


def run_validation(steps: int = 3) -> int:
    """Run every case, print the table; 0 when every deterministic quantity agrees, else 1."""
    rows: list[Row] = []
    for case in CASES:
        rows += compare(case, run_case(case, steps), steps)
    print(format_rows(rows), flush=True)
    bad = [r for r in rows if not r.ok]
    names = ", ".join(c.name for c in CASES)
    print(f"validate ({names}): {len(rows) - len(bad)} of {len(rows)} quantities agree", flush=True)
    return 1 if bad else 0
