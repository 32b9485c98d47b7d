"""How one rank computes a step's gradients, whatever the layout.

An engine holds this rank's part of the model (all of it, or its pipeline stage's chunks),
wrapped for data parallelism over the mesh's dp group. After `forward_backward` the local
parameters' `.grad` hold the gradient of the global batch's mean token loss, identical on
every dp replica, and the return value is that mean loss. The loop then clips by the global
norm (`clip.py`) and steps the optimizer, the same for every engine.

Tensor parallelism is applied to the model before an engine sees it; the engines only
finish what sequence parallelism leaves partial (LayerNorm gradients summed over tp).

- FlatEngine (pp = 1): micro-batches in turn, token-weighted, one gradient sync per step.
- PipelineEngine (pp > 1): the pipeline runtime runs the schedule over the pp group; the
  dp all-reduce of each chunk's gradients runs once, after the schedule ends.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from paratrain import comm
from paratrain.config import RunConfig
from paratrain.mesh import Mesh
from paratrain.parallel.data_parallel import DataParallel
from paratrain.parallel.pipeline import PipelineRuntime, build_schedule, split_into_stages
from paratrain.parallel.tensor_parallel_state import sync_sequence_parallel_grads
from paratrain.train.step import accumulate_gradients, evaluate


class FlatEngine:
    def __init__(self, model: nn.Module, mesh: Mesh, cfg: RunConfig) -> None:
        self.dp = DataParallel(model, mesh.group("dp"), cfg.parallel.bucket_mb, reduce_op="sum")
        self.modules = [self.dp.module]
        self.tp, self.pp = mesh.group("tp"), None  # the whole depth is on this rank

    def forward_backward(self, micro_batches: list[torch.Tensor]) -> tuple[float, int]:
        self.dp.zero_grad()
        loss, tokens = accumulate_gradients(self.dp, micro_batches)
        sync_sequence_parallel_grads(self.dp.module, self.tp)
        return loss, tokens

    def evaluate(self, batches: list[torch.Tensor]) -> float:
        return evaluate(self.dp.module, batches, self.dp.group)


class PipelineEngine:
    def __init__(self, model: nn.Module, mesh: Mesh, cfg: RunConfig) -> None:
        p, t = cfg.parallel, cfg.train
        pp = mesh.group("pp")
        chunks = split_into_stages(model, pp.rank, pp.size, chunks=p.chunks)
        schedule = build_schedule(p.schedule, pp.size, t.microbatches, p.chunks)
        self.runtime = PipelineRuntime(chunks, schedule, pp, hidden_size=cfg.model.d_model)
        self.dp_group = mesh.group("dp")
        self.wrapped = [
            DataParallel(c, self.dp_group, p.bucket_mb, reduce_op="avg") for c in chunks
        ]
        self.modules = list(chunks)
        self.tp, self.pp = mesh.group("tp"), pp

    def forward_backward(self, micro_batches: list[torch.Tensor]) -> tuple[float, int]:
        for w in self.wrapped:
            w.zero_grad()
        with contextlib.ExitStack() as stack:
            for w in self.wrapped:  # one dp all-reduce per chunk, after the whole schedule
                stack.enter_context(w.no_sync())
            loss = self.runtime.run_step(micro_batches)
        for w in self.wrapped:
            w.finish_gradient_sync()
            sync_sequence_parallel_grads(w.module, self.tp)
        tokens = sum(b[:, 1:].numel() for b in micro_batches)
        # The runtime weights every micro-batch equally: full-length rows only.
        stats = torch.tensor([loss * tokens, float(tokens)], dtype=torch.float64)
        comm.all_reduce(stats, self.dp_group, op="sum")
        return float(stats[0] / stats[1]), int(stats[1])

    def evaluate(self, batches: list[torch.Tensor]) -> float:
        mine = batches[self.dp_group.rank :: self.dp_group.size]
        loss = self.runtime.run_forward(mine) if mine else 0.0
        tokens = sum(b[:, 1:].numel() for b in mine)
        stats = torch.tensor([loss * tokens, float(tokens)], dtype=torch.float64)
        comm.all_reduce(stats, self.dp_group, op="sum")
        return float(stats[0] / stats[1]) if stats[1] > 0 else float("nan")


def build_engine(model: nn.Module, mesh: Mesh, cfg: RunConfig) -> FlatEngine | PipelineEngine:
    if mesh.size("pp") > 1:
        return PipelineEngine(model, mesh, cfg)
    return FlatEngine(model, mesh, cfg)
