"""What each rank of `paratrain bench pp` runs: our pipeline and torch's, pair by pair.

Ours is the engine `paratrain train --pp S` builds (`build_engine`: `split_into_stages`,
the `PipelineRuntime` and one `DataParallel` per chunk over the dp group of one rank,
reduce_op "avg") and the one `train_step`: the schedule, the global gradient norm over
the stages, the clip, AdamW. The peer (peer.py) gets a copy of the same GPT built from
the same seed and cut by the same `split_into_stages` (so the same blocks on the same
rank: virtual stage c * S + rank), the same K micro-batches of the same batches, the same
clipping, `AdamW(foreach=True)`, one thread and the same timer. Each timed step starts
after a barrier so that both ranks begin together; the parent takes the slower rank's
time, because a pipeline step ends when its last stage ends.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from paratrain import comm
from paratrain.bench.harness.pairs import time_pairs
from paratrain.bench.harness.sides import OurSide, norm_only
from paratrain.bench.pp.peer import PEER, build_peer, peer_step
from paratrain.config import RunConfig
from paratrain.mesh import Mesh
from paratrain.models.plans import GPT_PLAN
from paratrain.parallel.data_parallel.adamw import adamw
from paratrain.parallel.pipeline import split_into_stages
from paratrain.train.build import build_engine, build_model, compile_units, pipeline_plan

GPT_SPLIT = pipeline_plan(GPT_PLAN)


def compare_schedules(
    rank: int,
    world: int,
    names: list[str],
    batches: list[torch.Tensor],
    k: int,
    compile: bool = False,
) -> dict[str, dict[str, Any]]:
    """Every schedule in one launch: importing torch.distributed.pipelining alone takes
    about 6 s per process here (it pulls in DTensor and dynamo), so it is paid once."""
    from torch.distributed import pipelining  # noqa: F401  (the import, before any timing)

    mesh = Mesh.build(pp=world)
    return {name: compare_schedule(rank, world, mesh, name, batches, k, compile) for name in names}


def compare_schedule(
    rank: int,
    world: int,
    mesh: Mesh,
    name: str,
    batches: list[torch.Tensor],
    k: int,
    compile: bool = False,
) -> dict[str, Any]:
    """One warm-up step each, then one timed step of each per batch, alternating order.
    compile: both sides' blocks compiled (the warm-up step compiles them)."""
    cfg = pipeline_config(RunConfig(), world, name, k, batches[0].shape[0] // k)
    cfg.train.compile = compile
    t = cfg.train
    engine = build_engine(cfg, mesh)
    runtime = engine.runtime
    assert runtime is not None  # pp > 1: a pipeline engine
    ours, traces = OurSide(engine, cfg), []

    def our_step(batch: torch.Tensor) -> float:
        loss = ours(list(batch.split(t.micro_batch)))  # K micro-batches of (b, T + 1)
        traces.append(runtime.last_trace)  # the runtime's own timestamps
        return loss

    v = cfg.parallel.chunks
    model = build_model(cfg)
    compile_units(model, cfg)  # --compile: the peer's blocks as ours, before the split
    chunks = split_into_stages(model, rank, world, chunks=v, plan=GPT_SPLIT)
    params = list(nn.ModuleList(chunks).parameters())
    opt = adamw(nn.ModuleList(chunks), t.lr, t.weight_decay, (t.beta1, t.beta2))
    peer = functools.partial(
        peer_step, build_peer(chunks, rank, world, name, k), opt, lr=t.lr,
        grad_clip=t.grad_clip, params=params, rank=rank, world=world,
    )  # fmt: skip
    warm = (our_step(batches[0]), peer(batches[0]))  # shape inference, caches
    rows = time_pairs(our_step, peer, batches[1:], sync=lambda: comm.barrier(mesh.group("pp")))
    timed = [trace for trace in traces[1:] if trace is not None]  # each step leaves one
    return {
        "rows": rows,
        "micro_batch": t.micro_batch,
        "warmup_losses": warm,
        "bubbles": [trace.bubble_fraction() for trace in timed],
        "peak_in_flight": max(trace.peak_in_flight for trace in timed),
        "trace": timed[-1],  # of the last pair, for the Gantt chart
    }


def pipeline_config(cfg: RunConfig, world: int, name: str, k: int, b: int) -> RunConfig:
    """`cfg` for `paratrain train --pp world --schedule name`: K micro-batches of b."""
    cfg = norm_only(cfg)
    p, t = cfg.parallel, cfg.train
    p.pp, p.schedule, p.chunks = world, name, PEER[name][1]
    t.microbatches, t.micro_batch, t.global_batch = k, b, k * b
    return cfg
