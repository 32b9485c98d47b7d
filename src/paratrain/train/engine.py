"""How one rank computes a step's gradients, whatever the layout.

An engine holds this rank's part of the model (all of it, or its pipeline stage's chunks),
each piece wrapped for data parallelism over the mesh's dp group by `wrap.py` (plain,
ZeRO 1-2, FSDP, with or without mixed precision). After `forward_backward` the gradients
are those of the global batch's mean token loss, identical on every dp replica (or sharded
over it), and the return value is that mean loss. `clip` and `optimizer` then work the
same for every engine and wrapper.

Tensor parallelism is applied to the model before an engine sees it; the engines only
finish what sequence parallelism leaves partial (LayerNorm gradients summed over tp).

- FlatEngine (pp = 1): micro-batches in turn, token-weighted, one gradient sync per step.
- PipelineEngine (pp > 1): the pipeline runtime runs the schedule over the pp group; the
  dp reduction of each chunk's gradients runs once, after the schedule ends.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from paratrain import comm
from paratrain.config import RunConfig
from paratrain.mesh import Mesh
from paratrain.parallel.pipeline import PipelineRuntime, build_schedule, split_into_stages
from paratrain.train import wrap as wrapping
from paratrain.train.step import accumulate_gradients, evaluate


class Engine:
    wrappers: list[wrapping.Wrapper]
    modules: list[nn.Module]
    tp: comm.CommGroup
    pp: comm.CommGroup | None

    def build_optimizer(self, cfg: RunConfig, lr: float):
        return wrapping.build_optimizer(self.wrappers, cfg, lr)

    def clip(self, max_norm: float) -> float:
        return wrapping.clip(self.wrappers, max_norm, self.tp, self.pp)

    def finish(self) -> None:
        """After the last step: leave every module whole (ZeRO-3 gathers its units)."""
        for w in self.wrappers:
            if hasattr(w, "materialize"):
                w.materialize()


class FlatEngine(Engine):
    def __init__(self, model: nn.Module, mesh: Mesh, cfg: RunConfig) -> None:
        self.model = wrapping.wrap(model, mesh, cfg, reduce_op="sum")
        self.wrappers, self.modules = [self.model], [model]
        self.tp, self.pp = mesh.group("tp"), None  # the whole depth is on this rank

    def forward_backward(self, micro_batches: list[torch.Tensor]) -> tuple[float, int]:
        self.model.zero_grad()
        loss, tokens = accumulate_gradients(self.model, micro_batches)
        wrapping.sync_sequence_parallel(self.model, self.tp)
        wrapping.scale_gradients(self.wrappers, 1.0 / max(tokens, 1))
        return loss, tokens

    def evaluate(self, batches: list[torch.Tensor]) -> float:
        # Through the wrapper: under ZeRO-3 the module alone holds no parameters.
        return evaluate(self.model, batches, self.model.group)


class PipelineEngine(Engine):
    def __init__(self, model: nn.Module, mesh: Mesh, cfg: RunConfig) -> None:
        p, t = cfg.parallel, cfg.train
        pp = mesh.group("pp")
        chunks = split_into_stages(model, pp.rank, pp.size, chunks=p.chunks)
        schedule = build_schedule(p.schedule, pp.size, t.microbatches, p.chunks)
        self.runtime = PipelineRuntime(chunks, schedule, pp, hidden_size=cfg.model.d_model)
        self.dp_group = mesh.group("dp")
        # The runtime weights each micro-batch's mean loss by 1/K: replicas average.
        self.wrappers = [wrapping.wrap(c, mesh, cfg, reduce_op="avg") for c in chunks]
        self.modules = list(chunks)
        self.tp, self.pp = mesh.group("tp"), pp

    def forward_backward(self, micro_batches: list[torch.Tensor]) -> tuple[float, int]:
        for w in self.wrappers:
            w.zero_grad()
        with contextlib.ExitStack() as stack:
            for w in self.wrappers:  # one dp reduction per chunk, after the whole schedule
                stack.enter_context(w.no_sync())
            loss = self.runtime.run_step(micro_batches)
        for w in self.wrappers:
            w.finish_gradient_sync()
            wrapping.sync_sequence_parallel(w, self.tp)
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


def build_engine(model: nn.Module, mesh: Mesh, cfg: RunConfig) -> Engine:
    if mesh.size("pp") > 1:
        return PipelineEngine(model, mesh, cfg)
    return FlatEngine(model, mesh, cfg)
