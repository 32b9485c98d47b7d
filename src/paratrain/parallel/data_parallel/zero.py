"""ZeRO stages 0-2 over the data-parallel group: one flat buffer, each rank updates 1/k.

ZeRO (Rajbhandari et al., arXiv:1910.02054, sections 5 and 7) removes the k-fold copies
of model state that data parallelism keeps. Here, over the dp group of k ranks:

- stage 0: plain data parallelism on flat buffers (all-reduce), with mixed precision;
- stage 1 (P_os): optimizer moments and fp32 master weights sharded. Gradients are
  reduce-scattered, not all-reduced: each rank needs the reduced gradient of its own
  shard only. It updates that shard, and the updated parameters are all-gathered.
  Traffic (k-1)S/k + (k-1)S/k = 2(k-1)S/k, DDP's all-reduce volume (section 7.2.1);
- stage 2 (P_os+g): gradients sharded too. Each bucket's full gradients exist only from
  the backward hook that fills it until its reduce-scatter completes; then only this
  rank's part is kept, added into the gradient shard. Same traffic as stage 1.

With K micro-batches, stage 2 either reduce-scatters after every micro-batch into the
shard (accumulate="shard", the default, as DeepSpeed's ZeRO-2: gradient memory S/k plus
the buckets in flight, gradient traffic K(k-1)S/k) or holds the full gradients across
micro-batches and reduce-scatters once (accumulate="full": memory of the full gradient
until the last backward, so its peak exceeds stage 1's by the shard; traffic 2(k-1)S/k).

The flat buffer lists parameters in reverse order of registration, so buckets (contiguous
ranges of it) fill one after another during backward, as in the DDP wrapper; a bucket's
reduce-scatter starts from the hook that completes it and overlaps the earlier layers'
backward. Rank r owns flat elements [r s, (r+1) s), s = ceil(n / k) (flat_buffer.py): a
bucket's reduce-scatter gives each rank the part of the bucket inside its shard. Driven
through the `Replica` protocol (replica.py): the training step never asks the stage.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paratrain import comm
from paratrain.comm.compat import same_memory
from paratrain.config import ZERO2_ACCUMULATE
from paratrain.parallel.data_parallel.adamw import ShardedAdamW
from paratrain.parallel.data_parallel.compression import CompressSettings, compressor_state
from paratrain.parallel.data_parallel.flat_buffer import (
    FlatBucket,
    FlatLayout,
    FlatShard,
    flat_buckets,
    flatten,
    make_shard,
)
from paratrain.parallel.data_parallel.hybrid import HybridGroups
from paratrain.parallel.data_parallel.memory_count import count_memory
from paratrain.parallel.data_parallel.param_share import EVERY_PARAMETER, ParamShare
from paratrain.parallel.data_parallel.replica import MemoryReport
from paratrain.parallel.data_parallel.sharded_muon import ShardedMuon
from paratrain.parallel.data_parallel.sharded_replica import ShardedReplica
from paratrain.parallel.data_parallel.sync_switch import SyncSwitch
from paratrain.parallel.data_parallel.wrapper import broadcast_parameters
from paratrain.parallel.data_parallel.zero_compression import compressed_bucket, flat_compressor
from paratrain.parallel.mixed_precision import DynamicLossScaler, MixedPrecision, scale_backward


class ZeroDataParallel(SyncSwitch, ShardedReplica):
    """ZeRO stage 0, 1 or 2 of `module` over `group` (see the module docstring).

    reduce_op: "sum" for losses already normalised by the global token count (the training
    loop's way), "avg" for per-replica mean losses (DDP's way). accumulate: stage 2 with
    K micro-batches, "shard" (reduce-scatter each one) or "full" (module docstring).
    share: which of the module's parameters this wrapper holds (replica.ParamShare).
    hybrid: HSDP (hybrid.py): shard within `hybrid.shard`, a part of `group`.
    compress: error-feedback compression of the reductions (zero_compression.py).
    """

    def __init__(
        self,
        module: nn.Module,
        group: comm.CommGroup,
        stage: int = 1,
        precision: MixedPrecision | None = None,
        bucket_mb: float = 25.0,
        reduce_op: str = "sum",
        accumulate: str = "shard",
        share: ParamShare = EVERY_PARAMETER,
        hybrid: HybridGroups | None = None,
        compress: CompressSettings | None = None,
    ) -> None:
        super().__init__()
        if stage not in (0, 1, 2) or (hybrid is not None and stage == 0):
            raise ValueError(f"ZeroDataParallel stage {stage}; valid: 0, 1, 2 (HSDP: 1, 2)")
        if reduce_op not in ("avg", "sum") or accumulate not in ZERO2_ACCUMULATE:
            raise ValueError(f"reduce_op {reduce_op!r} / accumulate {accumulate!r}")
        self.module, self.group, self.stage, self.hybrid = module, group, stage, hybrid
        self.precision = precision or MixedPrecision()
        self.reduce_op, self.accumulate, self.share = reduce_op, accumulate, share
        broadcast_parameters(module, group, share)
        named = share.named(module)[::-1]
        self._params = [p for _, p in named]
        rank = self.shard_group.rank if stage >= 1 else 0  # under HSDP, in a replica group
        self.layout = FlatLayout(named, self.shard_group.size if stage >= 1 else 1)
        flat_dtype, has_master = self.precision.param_dtype, self.precision.has_master
        self.flat_params, master_from = flatten(
            self._params, self.layout, flat_dtype, has_master, rank
        )
        lo, hi = self.layout.shard_range(rank)
        dtype = self.precision.param_dtype
        self.shard = make_shard(self.layout, rank, self.flat_params[lo:hi], dtype, master_from)
        self.flat_grads: torch.Tensor | None = None
        if stage <= 1:  # full gradients live in one buffer; .grad are views into it
            self.flat_grads = self.flat_params.new_zeros(self.layout.padded, dtype=dtype)
            self.shard.grad = self.flat_grads[lo:hi]
        self._grad_views = self.layout.views(self.flat_grads) if self.flat_grads is not None else []
        self.buckets = flat_buckets(
            self.layout, int(bucket_mb * 2**20), self.shard.grad.element_size()
        )
        device = self.flat_params.device
        self.compressor = flat_compressor(
            compress, self.layout, self.buckets, group, hybrid, stage, device
        )
        self._where: dict[int, tuple[FlatBucket, int]] = {}
        for b in self.buckets:
            for i in b.params:
                self._where[id(self._params[i])] = (b, i)
        for p in self._params:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self.scaler = None
        if self.precision.needs_loss_scaling:
            self.scaler = DynamicLossScaler(
                self.precision.initial_loss_scale, self.precision.growth_interval
            )
        self._sync, self._next_launch, self._flush_queued = True, 0, False
        self._pending: list[tuple[FlatBucket, comm.Pending, torch.Tensor]] = []
        self._touched: set[int] = set()
        self.zero_grad()

    # -- the driving interface shared with DataParallel -------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.module(*args, **kwargs)
        return scale_backward(out, self.scaler.scale) if self.scaler is not None else out

    @property
    def _per_micro_batch(self) -> bool:
        return self.stage == 2 and self.accumulate == "shard"

    def _syncing(self) -> bool:
        return self._sync or self._per_micro_batch

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        bucket, i = self._where[id(p)]
        seg = self.layout.segments[i]
        if self.stage <= 1:
            view = self._grad_views[i]
            if p.grad is not None and not same_memory(p.grad, view):
                view.copy_(p.grad)  # .grad was replaced since zero_grad: first gradient
                p.grad = view
        else:
            if bucket.buffer is None:
                bucket.buffer = self.shard.grad.new_zeros(bucket.end - bucket.start)
            assert p.grad is not None
            bucket.buffer[seg.start - bucket.start : seg.end - bucket.start].add_(p.grad.view(-1))
            p.grad = None  # the bucket holds it now: never two full copies
        self._touched.add(id(p))
        if not self._syncing():
            return
        if self._per_micro_batch and not self._flush_queued:
            # A parameter unused in this backward would leave its bucket incomplete:
            # flush everything at the end of each backward so micro-batches stay apart.
            self._flush_queued = True
            self.at_backward_end(self._flush)
        bucket.ready.add(i)
        self._launch_ready()

    def _flush(self) -> None:
        self._flush_queued = False
        self._launch_ready(force=True)
        # Wait for this backward's reduce-scatters before it returns, as DeepSpeed's ZeRO-2
        # does at the end of each backward: their whole buckets die here, so between
        # micro-batches (the next forward's activations) only the shard is held. Left to
        # the next backward's hooks, they would sit beside those activations.
        self._drain()
        self._reset_round()

    def _drain(self) -> None:
        while self._pending:
            self._complete(*self._pending.pop(0))

    def _launch_ready(self, force: bool = False) -> None:
        """Launch complete buckets strictly in index order (the same calls on every rank)."""
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if not (force or len(bucket.ready) == len(bucket.params)):
                break
            self._launch(bucket)
            self._next_launch += 1
        while self._pending and self._pending[0][1].is_completed():
            self._complete(*self._pending.pop(0))  # free stage 2 buffers as soon as done

    def _launch(self, bucket: FlatBucket) -> None:
        if self.flat_grads is not None:
            data = self.flat_grads[bucket.start : bucket.end]
        else:
            if bucket.buffer is None:  # no parameter of it got a gradient here
                bucket.buffer = self.shard.grad.new_zeros(bucket.end - bucket.start)
            data, bucket.buffer = bucket.buffer, None  # in flight: the next backward
            # (accumulate="shard") starts a fresh buffer; this one dies when reduced
        reduce_dtype = self.precision.reduce_dtype
        send = data if data.dtype == reduce_dtype else data.to(reduce_dtype)
        handle: comm.Pending
        if self.compressor is not None and self.compressor.active and self.hybrid is None:
            args = (self.layout, bucket, send, self.group, self.stage, self.reduce_op)
            handle = compressed_bucket(self.compressor, *args)
        elif self.stage == 0:
            handle = comm.all_reduce(send, self.group, op=self.reduce_op, async_op=True)
        else:
            sizes = self.layout.split_sizes(bucket.start, bucket.end)
            handle = comm.reduce_scatter(
                send, self.shard_group, op=self.reduce_op, sizes=sizes, async_op=True
            )
        self._pending.append((bucket, handle, send))

    def _complete(self, bucket: FlatBucket, handle: comm.Pending, send: torch.Tensor) -> None:
        result = handle.wait()
        if self.stage == 0 and self.flat_grads is not None:  # always set at stage 0
            if not same_memory(result, self.flat_grads[bucket.start : bucket.end]):
                self.flat_grads[bucket.start : bucket.end].copy_(result)
            return
        lo, hi = self.layout.shard_range(self.shard.rank)
        a, b = max(bucket.start, lo), min(bucket.end, hi)
        if a < b:
            target = self.shard.grad[a - lo : b - lo]
            target.copy_(result) if self.stage == 1 else target.add_(result)

    def _reset_round(self) -> None:
        self._next_launch = 0
        for b in self.buckets:
            b.ready.clear()

    def finish_gradient_sync(self) -> None:
        """Launch what is left (parameters without a gradient contribute zeros), wait."""
        if not self._per_micro_batch:  # else every backward already flushed its round
            self._launch_ready(force=True)
        self._drain()
        self._reset_round()
        self._touched.clear()
        self._all_reduce_across_replicas()
        if self.compressor is not None:
            self.compressor.finish_step()
        if self.stage >= 1:  # only the shard's gradient is reduced: hide the rest
            for p in self._params:
                p.grad = None

    def zero_grad(self, set_to_none: bool = False) -> None:
        del set_to_none  # gradients live in the wrapper's buffers
        self.shard.grad.zero_()
        if self.flat_grads is not None:
            self.flat_grads.zero_()
            for p, view in zip(self._params, self._grad_views, strict=True):
                p.grad = view
        for b in self.buckets:
            b.buffer = None

    # -- what the shared half of the protocol needs (sharded_replica.py) ----------------------
    @property
    def shards(self) -> list[FlatShard]:
        return [self.shard]

    @property
    def sharded_over(self) -> comm.CommGroup | None:
        return self.shard_group if self.stage >= 1 else None

    def _after_update(self) -> None:
        if self.stage >= 1:
            self._gather_params()

    @torch.no_grad()
    def _gather_params(self) -> None:
        """Every rank updated its shard: all-gather them into the full parameters, in
        place (the shard is this rank's piece of them): no full-size receive buffer."""
        sizes = [self.layout.shard] * self.shard_group.size
        comm.all_gather_flat(self.shard.param, self.shard_group, sizes=sizes, out=self.flat_params)

    # -- state -----------------------------------------------------------------------------
    def memory_report(self, optimizer: ShardedAdamW | ShardedMuon | None = None) -> MemoryReport:
        known = [("params", self.flat_params), ("grads", self.shard.grad)]
        known += [("params", p) for _, p in self.share.frozen(self.module)]  # LoRA's base
        known += [("grads", b.buffer) for b in self.buckets if b.buffer is not None]
        known += [("grads", send) for _, _, send in self._pending]
        if self.flat_grads is not None:
            known.append(("grads", self.flat_grads))
        known += [("grads", t) for t in compressor_state(self.compressor)]  # errors, factors
        if self.shard.master is not None:
            known.append(("master", self.shard.master))
        pad = self.layout.padding
        padding = {"params": pad * self.flat_params.element_size()}
        if self.flat_grads is not None:
            padding["grads"] = pad * self.flat_grads.element_size()
        states = optimizer.states if optimizer is not None else ()
        whole = self.module if self.share.names is None else None  # else count the share
        return count_memory(known, padding, whole, states)

    def materialize(self) -> None:
        """The full parameters are always there."""
