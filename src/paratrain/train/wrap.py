"""Pick the data-parallel wrapper for a module, and what goes with it: the optimizer and the
global-norm clip. The engines call these three and never ask which wrapper they got.

- float32 and --zero 0: DataParallel (gradients whole on every replica, in `.grad`).
- --zero 1 or 2, or a 16-bit --dtype: ZeroDataParallel (stage 0 for mixed precision alone).
- --zero 3: FullyShardedDataParallel over the model's FSDP units.
Sharded wrappers keep the reduced gradient only as this rank's shard, so scaling, clipping
and the optimizer go through them rather than through `p.grad`.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from paratrain import comm
from paratrain.config import RunConfig
from paratrain.mesh import Mesh
from paratrain.parallel.data_parallel import DataParallel
from paratrain.parallel.fsdp import FullyShardedDataParallel, gpt_units
from paratrain.parallel.mixed_precision import MixedPrecision
from paratrain.parallel.tensor_parallel_state import (
    sequence_parallel_parameters,
    sharded_parameters,
    sync_sequence_parallel_grads,
)
from paratrain.parallel.zero import ZeroDataParallel
from paratrain.train.clip import clip_global_norm
from paratrain.train.optim import build_adamw
from paratrain.validate import compute_dtype

Wrapper = DataParallel | ZeroDataParallel | FullyShardedDataParallel


def wrap(module: nn.Module, mesh: Mesh, cfg: RunConfig, reduce_op: str) -> Wrapper:
    p, dp, dtype = cfg.parallel, mesh.group("dp"), compute_dtype(cfg)
    if p.zero == 0 and dtype == "float32":
        return DataParallel(module, dp, p.bucket_mb, reduce_op=reduce_op)
    precision = dataclasses.replace(
        MixedPrecision.of(dtype), initial_loss_scale=cfg.train.loss_scale
    )
    if p.zero == 3:
        return FullyShardedDataParallel(
            module, dp, gpt_units(module), precision, prefetch=p.prefetch, reduce_op=reduce_op
        )
    return ZeroDataParallel(
        module,
        dp,
        p.zero,
        precision,
        p.bucket_mb,
        reduce_op=reduce_op,
        accumulate=p.zero2_accumulate if p.zero == 2 else "full",
    )


class OptimizerSet:
    """Several sharded optimizers (one per pipeline chunk) driven as one."""

    def __init__(self, optimizers: list) -> None:
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.optimizers for g in o.param_groups]

    def step(self) -> None:
        for o in self.optimizers:
            o.step()


def build_optimizer(wrappers: list[Wrapper], cfg: RunConfig, lr: float):
    t = cfg.train
    betas = (t.beta1, t.beta2)
    if all(isinstance(w, DataParallel) for w in wrappers):
        return build_adamw(nn.ModuleList([w.module for w in wrappers]), lr, t.weight_decay, betas)
    return OptimizerSet([w.build_optimizer(lr, t.weight_decay, betas) for w in wrappers])


def sync_sequence_parallel(w: Wrapper, tp: comm.CommGroup) -> None:
    """Sum over tp the gradients sequence parallelism left partial (LayerNorms, position
    embedding, row-parallel biases), wherever this wrapper keeps the reduced gradient.

    Plain data parallelism: in `p.grad`. Sharded wrappers: only in this rank's shard, so
    the pieces of those parameters in it are summed; every tp rank of a dp rank holds the
    same pieces (the same local parameters in the same order), and sums commute with the
    dp reduction that came first.
    """
    if isinstance(w, DataParallel):
        sync_sequence_parallel_grads(w.module, tp)
        return
    partial = {id(p) for p in sequence_parallel_parameters(w.module)}
    if tp.size == 1 or not partial:
        return
    names = {n for n, p in w.module.named_parameters() if id(p) in partial}
    views = []
    for shard in w.shards if isinstance(w, FullyShardedDataParallel) else [w.shard]:
        pieces = shard.layout.local_pieces(shard.rank)
        views += [
            v
            for piece, v in zip(pieces, shard.piece_views(shard.grad), strict=True)
            if piece.segment.name in names
        ]
    flat = torch.cat(views) if views else torch.zeros(0)
    comm.all_reduce(flat, tp, op="sum")
    offset = 0
    for v in views:
        v.copy_(flat[offset : offset + v.numel()])
        offset += v.numel()


def scale_gradients(wrappers: list[Wrapper], factor: float) -> None:
    for w in wrappers:
        if isinstance(w, DataParallel):
            grads = [p.grad for p in w.module.parameters() if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, factor)
        else:
            w.scale_grads_(factor)


def clip(
    wrappers: list[Wrapper], max_norm: float, tp: comm.CommGroup, pp: comm.CommGroup | None
) -> float:
    """Global norm over every parameter counted once (see clip.py); clip if above max_norm."""
    if all(isinstance(w, DataParallel) for w in wrappers):
        return clip_global_norm([w.module for w in wrappers], max_norm, tp, pp)
    squares = torch.zeros(2, dtype=torch.float64)  # (tp-split, replicated) on this rank
    for w in wrappers:
        split = set(sharded_parameters(w.module))
        shards = w.shards if isinstance(w, FullyShardedDataParallel) else [w.shard]
        for shard in shards:
            pieces = shard.layout.local_pieces(shard.rank)
            for piece, view in zip(pieces, shard.piece_views(shard.grad), strict=True):
                squares[0 if piece.segment.name in split else 1] += view.double().pow(2).sum()
    if any(_is_sharded(w) for w in wrappers):  # dp ranks hold disjoint shards: add them
        comm.all_reduce(squares, wrappers[0].group, op="sum")
    if tp.size > 1:
        comm.all_reduce(squares[:1], tp, op="sum")
    total = squares.sum().reshape(1)
    if pp is not None and pp.size > 1:
        comm.all_reduce(total, pp, op="sum")
    norm = float(total.sqrt())
    if max_norm > 0 and norm > max_norm:
        scale_gradients(wrappers, max_norm / (norm + 1e-6))
    return norm


def _is_sharded(w: Wrapper) -> bool:
    return isinstance(w, FullyShardedDataParallel) or (
        isinstance(w, ZeroDataParallel) and w.stage >= 1
    )


def model_state_bytes(wrappers: list[Wrapper], optimizer) -> dict[str, int]:
    """Bytes of model state held on this rank, by kind (params, grads, optimizer, master).

    DataParallel: whole parameters, their bucket buffers and AdamW's moments; sharded
    wrappers report their own (shards, transient buffers, master copies, padding). AdamW's
    scalar step counters are left out, as the planner does.
    """
    totals = {"params": 0, "grads": 0, "optimizer": 0, "master": 0}
    if all(isinstance(w, DataParallel) for w in wrappers):
        for w in wrappers:
            totals["params"] += sum(p.numel() * p.element_size() for p in w.module.parameters())
            totals["grads"] += sum(b.nbytes for b in w.buckets)
        for state in optimizer.state.values():
            totals["optimizer"] += sum(
                t.numel() * t.element_size() for k, t in state.items() if k != "step"
            )
        return totals
    for w, opt in zip(wrappers, optimizer.optimizers, strict=True):
        report = w.memory_report(opt).as_dict()
        for kind in ("grads", "optimizer", "master"):
            totals[kind] += report[kind]
        totals["params"] += report["params"] + report["padding"]
    return totals
