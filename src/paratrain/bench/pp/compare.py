"""What each rank of `paratrain bench pp` runs: our pipeline and torch's, pair by pair.

Both sides get a copy of the same GPT built from the same seed, cut by the same
`split_into_stages` (so the same blocks on the same rank: virtual stage c * S + rank), the
same K micro-batches of the same batches, `AdamW(foreach=True)`, one thread and the same
timer. A timed step is zero_grad, the pipeline step, optimizer.step, started after a barrier
so that both ranks begin together; the parent takes the slower rank's time, because a
pipeline step ends when its last stage ends.

The peer is `torch.distributed.pipelining`: `PipelineStage` per chunk and the schedule
class in PEER, with a mean cross-entropy `loss_fn` and `scale_grads=True` (gradients
divided by K), which is the arithmetic of our runtime (each micro-batch's mean loss / K).
`return_outputs=False`, since ours does not gather the logits either.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from torch import nn

from paratrain import comm
from paratrain.config import RunConfig
from paratrain.mesh import Mesh
from paratrain.models.plans import GPT_PLAN
from paratrain.parallel.adamw import adamw
from paratrain.parallel.pipeline import PipelineRuntime, build_schedule, split_into_stages
from paratrain.train.build import build_model, pipeline_plan

# Ours -> (torch.distributed.pipelining schedule class, chunks per stage on both sides).
# torch's ScheduleInterleavedZeroBubble with one stage per rank is its ZB1P schedule
# without interleaving, the counterpart of our ZB-H1 (arXiv:2401.10241, 3.1).
PEER = {
    "gpipe": ("ScheduleGPipe", 1),
    "1f1b": ("Schedule1F1B", 1),
    "interleaved": ("ScheduleInterleaved1F1B", 2),
    "zb-h1": ("ScheduleInterleavedZeroBubble", 1),
}
SINGLE_STAGE = ("ScheduleGPipe", "Schedule1F1B")  # take one stage, the others a list


class _PeerChunk(nn.Module):
    """A chunk as torch's stage calls it: one positional input, logits out on the last.

    Our chunks compute the loss themselves when given targets; torch's schedule applies
    `loss_fn` to the last stage's output instead, so the wrapper never passes targets.
    """

    def __init__(self, chunk: nn.Module) -> None:
        super().__init__()
        self.chunk = chunk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.chunk(x)  # (b, T, C) hidden states, or (b, T, V) logits on the last


GPT_SPLIT = pipeline_plan(GPT_PLAN)


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())  # (bT, V)


def build_peer(chunks: list[nn.Module], rank: int, world: int, name: str, k: int) -> Any:
    """torch's schedule over this rank's chunks (same stage indices as ours)."""
    from torch.distributed import pipelining

    cls_name, v = PEER[name]
    stages = [
        pipelining.PipelineStage(_PeerChunk(c), i * world + rank, world * v, torch.device("cpu"))
        for i, c in enumerate(chunks)
    ]
    cls = getattr(pipelining, cls_name)
    first = stages[0] if cls_name in SINGLE_STAGE else stages
    return cls(first, k, loss_fn=_cross_entropy, scale_grads=True)


def _peer_step(
    schedule: Any, opt: torch.optim.Optimizer, batch: torch.Tensor, rank: int, world: int
) -> float:
    opt.zero_grad(set_to_none=True)
    losses: list[torch.Tensor] = []
    if rank == 0:
        schedule.step(batch[:, :-1], return_outputs=False)  # first stage: token ids
    elif rank == world - 1:
        schedule.step(target=batch[:, 1:], losses=losses, return_outputs=False)
    else:
        schedule.step(return_outputs=False)
    opt.step()
    # The loss lives on the last stage; the parent reads it from the last rank.
    return float(torch.stack(losses).detach().mean()) if losses else math.nan


def _our_step(
    runtime: PipelineRuntime, opt: torch.optim.Optimizer, batch: torch.Tensor, b: int
) -> float:
    opt.zero_grad(set_to_none=True)
    loss = runtime.run_step(list(batch.split(b)))  # K micro-batches of (b, T + 1)
    opt.step()
    return loss


def compare_schedules(
    rank: int, world: int, names: list[str], batches: list[torch.Tensor], k: int
) -> dict[str, dict[str, Any]]:
    """Every schedule in one launch: importing torch.distributed.pipelining alone takes
    about 6 s per process here (it pulls in DTensor and dynamo), so it is paid once."""
    from torch.distributed import pipelining  # noqa: F401  (the import, before any timing)

    group = Mesh.build(pp=world).group("pp")
    return {name: compare_schedule(rank, world, group, name, batches, k) for name in names}


def compare_schedule(
    rank: int, world: int, group: comm.CommGroup, name: str, batches: list[torch.Tensor], k: int
) -> dict[str, Any]:
    """One warm-up step each, then one timed step of each per batch, alternating order."""
    cfg = RunConfig()
    t = cfg.train
    _, v = PEER[name]
    betas = (t.beta1, t.beta2)
    b = batches[0].shape[0] // k
    ours_chunks = split_into_stages(build_model(cfg), rank, world, chunks=v, plan=GPT_SPLIT)
    runtime = PipelineRuntime(
        ours_chunks, build_schedule(name, world, k, v), group, hidden_size=cfg.model.d_model
    )
    ours_opt = adamw(nn.ModuleList(ours_chunks), t.lr, t.weight_decay, betas)
    peer_chunks = split_into_stages(build_model(cfg), rank, world, chunks=v, plan=GPT_SPLIT)
    peer = build_peer(peer_chunks, rank, world, name, k)
    peer_opt = adamw(nn.ModuleList(peer_chunks), t.lr, t.weight_decay, betas)

    def run(is_ours: bool, batch: torch.Tensor) -> tuple[float, float]:
        comm.barrier(group)
        start = time.perf_counter()
        if is_ours:
            loss = _our_step(runtime, ours_opt, batch, b)
        else:
            loss = _peer_step(peer, peer_opt, batch, rank, world)
        return time.perf_counter() - start, loss

    warm = (run(True, batches[0])[1], run(False, batches[0])[1])  # shape inference, caches
    rows, bubbles, peaks = [], [], []
    for i, batch in enumerate(batches[1:]):
        times, losses = {}, {}
        for is_ours in (True, False) if i % 2 == 0 else (False, True):
            times[is_ours], losses[is_ours] = run(is_ours, batch)
        rows.append((times[True], times[False], losses[True], losses[False]))
        trace = runtime.last_trace
        assert trace is not None
        bubbles.append(trace.bubble_fraction())
        peaks.append(trace.peak_in_flight)
    return {
        "rows": rows,
        "warmup_losses": warm,
        "bubbles": bubbles,
        "peak_in_flight": max(peaks),
        "trace": runtime.last_trace,  # of the last pair, for the Gantt chart
    }
