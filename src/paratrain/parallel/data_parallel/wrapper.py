"""Data parallelism: replicas start equal and average their gradients, overlapped with backward.

Every replica holds the whole model and a different slice of the global batch; reducing the
gradients over the dp group makes each optimizer step equal to one step on the whole batch
(seeds, definition 9.2.1). As in PyTorch DDP (arXiv:2006.15704), gradients are grouped in
buckets in reverse order of use; a hook on each parameter notes when its gradient is
complete, and a bucket's all-reduce starts, asynchronously, as soon as the bucket is full,
while autograd goes on with earlier layers. Buckets are launched strictly in index order
so that every rank issues the same sequence of collectives even when a parameter is unused
on some ranks; `finish_gradient_sync` launches what is left and waits for everything.

Usage from a user's own loop:

    model = DataParallel(MyModel(), mesh.group("dp"))
    for batch in my_shard:
        loss = loss_fn(model(batch.x), batch.y)
        loss.backward()
        model.finish_gradient_sync()
        optimizer.step()
        model.zero_grad()
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from paratrain import comm
from paratrain.comm.compat import same_memory
from paratrain.parallel.data_parallel.adamw import adamw
from paratrain.parallel.data_parallel.buckets import Bucket, build_buckets
from paratrain.parallel.data_parallel.compression import (
    CompressSettings,
    GradCompressor,
    Reduced,
    compressor_state,
    reduced_buffer,
)
from paratrain.parallel.data_parallel.memory_count import count_memory
from paratrain.parallel.data_parallel.muon import WholeMuon, muon_matrix_names
from paratrain.parallel.data_parallel.muon_math import MuonSettings
from paratrain.parallel.data_parallel.param_share import EVERY_PARAMETER, ParamShare
from paratrain.parallel.data_parallel.replica import GradSquares, MemoryReport, StatePiece
from paratrain.parallel.data_parallel.sgd import sgd as plain_sgd
from paratrain.parallel.data_parallel.sync_switch import SyncSwitch
from paratrain.parallel.data_parallel.whole_module import (
    all_reduce_whole_grads_,
    complete_state_dict,
    device_of,
    scale_whole_grads_,
    whole_checkpoint_pieces,
    whole_grad_squares,
)
from paratrain.parallel.mixed_precision import DynamicLossScaler


def broadcast_parameters(
    model: nn.Module, group: comm.CommGroup, share: ParamShare = EVERY_PARAMETER
) -> None:
    """Copy group rank 0's parameters (of `share`) and buffers to every replica, in one
    message."""
    params = [p for _, p in share.named(model)]
    tensors = [t.data for t in (*params, *model.buffers())]
    if group.size == 1 or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    comm.broadcast(flat, group, src=0)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def _bucket_reduced(bucket: Bucket, group: comm.CommGroup, settings: CompressSettings) -> Reduced:
    shapes, at = [], 0
    for p in bucket.params:
        shapes.append((at, p.shape))
        at += p.numel()
    return reduced_buffer(f"bucket{bucket.index}", shapes, at, group, True, settings)


class DataParallel(SyncSwitch, nn.Module):
    """Wrap any module for data-parallel training over `group` (a `Replica`).

    reduce_op: "avg" divides the summed gradients by the group size (DDP's behaviour);
    "sum" is for losses already normalised by the global token count.
    share: which of the module's parameters this wrapper holds (replica.ParamShare).
    compress: error-feedback compression of the all-reduce (compression.py); a bucket is
    then reduced where it completes, without overlap.
    """

    scaler: DynamicLossScaler | None = None  # float32 throughout (mixed precision: zero.py)

    def __init__(
        self,
        module: nn.Module,
        group: comm.CommGroup,
        bucket_mb: float = 25.0,
        reduce_op: str = "avg",
        broadcast_buffers: bool = True,
        share: ParamShare = EVERY_PARAMETER,
        compress: CompressSettings | None = None,
    ) -> None:
        super().__init__()
        if reduce_op not in ("avg", "sum"):
            raise ValueError(f"reduce_op {reduce_op!r}; valid: avg, sum")
        self.module = module
        self.group = group
        self.reduce_op = reduce_op
        self.broadcast_buffers = broadcast_buffers
        self.share = share
        broadcast_parameters(module, group, share)
        # Once: a traversal of the module per step (norm, scale) costs about 1% of the
        # bench's step; the wrapper serves these same parameters for its life.
        self._trained = share.named(module)
        params = [p for _, p in self._trained]
        # A group of one has nothing to reduce: no buckets and no hooks. Its gradients are
        # autograd's own, set to None before each step, as in a plain loop: buckets would
        # zero every gradient and then add the first micro-batch's into it, two passes over
        # them per step (4-5% of the bench model's step against transformers' in a plain
        # loop), and a hook per parameter costs about 3% of a pipeline step.
        overlap = group.size > 1
        self.buckets = build_buckets(params, int(bucket_mb * 2**20)) if overlap else []
        self._bucket_of: dict[int, tuple[Bucket, int]] = {}
        for bucket in self.buckets:
            for i, p in enumerate(bucket.params):
                self._bucket_of[id(p)] = (bucket, i)
                p.grad = bucket.views[i]
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self.compressor = None
        if compress is not None and overlap:
            reduced = [_bucket_reduced(b, group, compress) for b in self.buckets]
            self.compressor = GradCompressor(compress, reduced, device_of(module))
        self._sync = True
        self._next_launch = 0
        self._handles: list[Any] = []
        self._touched: set[int] = set()  # params whose hook fired since the last sync

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.broadcast_buffers and self.group.size > 1:
            buffers = list(self.module.buffers())
            if buffers:  # e.g. BatchNorm running statistics: rank 0's are the truth
                for b in buffers:
                    comm.broadcast(b.data, self.group, src=0)
        return self.module(*args, **kwargs)

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        bucket, i = self._bucket_of[id(p)]
        view = bucket.views[i]  # autograd adds into it in place: the same object, mostly
        if p.grad is not view and p.grad is not None and not same_memory(p.grad, view):
            # .grad was replaced (zero_grad(set_to_none=True) before this backward): this
            # is the first gradient of the step, so it overwrites the stale view.
            view.copy_(p.grad)
            p.grad = view
        self._touched.add(id(p))
        if not self._sync:
            return
        bucket.ready.add(id(p))
        self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        """Launch complete buckets in index order; with force, launch all the rest."""
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if not (force or bucket.is_complete()):
                return
            if force:
                self._attach_unused(bucket)
            self._handles.append(self._reduce(bucket))
            self._next_launch += 1

    def _reduce(self, bucket: Bucket) -> Any:
        """The bucket's all-reduce in flight, or done where it is compressed."""
        if self.compressor is None or not self.compressor.active:
            return comm.all_reduce(bucket.buffer, self.group, op=self.reduce_op, async_op=True)
        key, op = f"bucket{bucket.index}", self.reduce_op
        bucket.buffer.copy_(self.compressor.reduce(key, bucket.buffer, self.group, op, None))
        return comm.Done(bucket.buffer)

    def _attach_unused(self, bucket: Bucket) -> None:
        """Bring every gradient of a bucket launched without all its hooks into the buffer.

        A gradient set outside autograd's accumulation (e.g. a pipeline's deferred weight
        gradient assigned to .grad) is copied in; a parameter that got no gradient at all
        this step contributes zeros, since other ranks may have one for it.
        """
        for p, view in zip(bucket.params, bucket.views, strict=True):
            if p.grad is not None and not same_memory(p.grad, view):
                view.copy_(p.grad)
            elif p.grad is None and id(p) not in self._touched:
                view.zero_()
            p.grad = view  # every rank then steps on the same reduced gradient

    def finish_gradient_sync(self) -> None:
        """Launch buckets whose parameters got no gradient this step, then wait for all."""
        self._launch_ready(force=True)
        for handle in self._handles:
            handle.wait()
        self._handles.clear()
        self._next_launch = 0
        self._touched.clear()
        if self.compressor is not None:
            self.compressor.finish_step()
        for bucket in self.buckets:
            bucket.ready.clear()

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero the bucket buffers (the gradients are views into them); a group of one
        sets its gradients to None."""
        del set_to_none  # the views must stay: gradients live in the buckets
        if not self.buckets:
            for _, p in self._trained:
                p.grad = None
        for bucket in self.buckets:
            bucket.buffer.zero_()
            for p, view in zip(bucket.params, bucket.views, strict=True):
                p.grad = view

    # -- the rest of the Replica protocol: gradients are whole, in p.grad ------------------
    def scale_grads_(self, factor: float) -> None:
        scale_whole_grads_(self._trained, factor)

    def grad_squares(self) -> GradSquares:
        # every replica holds the whole gradient (of its share)
        return whole_grad_squares(self._trained, device_of(self.module), self.share.split_over)

    def all_reduce_grads_(
        self, names: Sequence[str], group: comm.CommGroup, same_layout: bool = True
    ) -> None:
        del same_layout  # whole gradients: the same on every rank whatever else differs
        mine = self.share.names
        all_reduce_whole_grads_(self.module, [n for n in names if mine is None or n in mine], group)

    def build_optimizer(
        self,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        eps: float = 1e-8,
        muon: MuonSettings | None = None,
        tp: comm.CommGroup | None = None,
        sgd: bool = False,
    ) -> torch.optim.Optimizer | WholeMuon:
        mine = self.share.names
        if sgd:
            return plain_sgd(self.module, lr, weight_decay, mine)
        if muon is None:
            return adamw(self.module, lr, weight_decay, betas, eps, mine)
        matrices = [
            n for n in muon_matrix_names(self.module, muon.matrices) if mine is None or n in mine
        ]
        others = [n for n, _ in self.share.named(self.module) if n not in set(matrices)]
        rest = adamw(self.module, lr, weight_decay, betas, eps, others)
        return WholeMuon(self.module, matrices, rest, self.group, lr, weight_decay, muon, tp)

    def memory_report(self, optimizer: torch.optim.Optimizer | None = None) -> MemoryReport:
        """Whole parameters, the bucket buffers that hold the gradients, AdamW's moments
        (of this wrapper's share: storage outside it is another wrapper's to count)."""
        known: list[tuple[str, torch.Tensor | None]]
        known = [("params", p) for _, p in self.share.named(self.module)]
        known += [("params", p) for _, p in self.share.frozen(self.module)]  # LoRA's base
        known += [("grads", b.buffer) for b in self.buckets]
        if not self.buckets:  # a group of one: autograd's own gradients, where there are any
            known += [("grads", p.grad) for _, p in self._trained]
        known += [("grads", t) for t in compressor_state(self.compressor)]  # errors, factors
        states = optimizer.state.values() if optimizer is not None else ()
        whole = self.module if self.share.names is None else None
        return count_memory(known, {}, whole, states)

    def checkpoint_pieces(
        self, optimizer: torch.optim.Optimizer
    ) -> tuple[list[StatePiece], list[torch.Tensor]]:
        return whole_checkpoint_pieces(self.module, optimizer, self.share.names)

    def after_load(self) -> None:
        """Every rank loaded the whole values: nothing else holds a copy."""

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        values = {n: p.detach().clone() for n, p in self.module.named_parameters()}
        return complete_state_dict(self.module, values)

    def materialize(self) -> None:
        """The module is always whole."""
