"""ZeRO-3 / FSDP: parameters sharded too, each unit gathered just in time and freed.

ZeRO stage 3 (P_os+g+p, arXiv:1910.02054, sections 5.3 and 7.2.2) and PyTorch FSDP
(Zhao et al., arXiv:2304.11277, section 3): every rank keeps 1/k of each unit's
parameters, gradients, master weights and moments, 16N/k bytes with Adam. Per micro-batch:

- before a unit's forward its parameters are all-gathered, and freed after it;
- before its backward (a hook on its outputs' gradients) they are all-gathered again,
  and freed when all its gradients have arrived;
- its gradients are then reduce-scattered, each rank adding its part into its shard.

That is (k-1)S/k for each of the three, 3(k-1)S/k per micro-batch, 1.5 times DDP's
volume (ZeRO section 7.2.2), and K times that with K micro-batches, since the full
gradients are not kept between micro-batches.

Prefetch (FSDP section 3.3.2, forward and backward prefetching): with depth d, the
pre-forward of unit u issues the gathers of units u+1..u+d, and the pre-backward of
unit u those of u-1..u-d, so that they run while unit u computes. Depth 0 gathers each
unit only when it is needed; each extra unit of depth costs one more unit of gathered
parameters at the peak (`peak_gathered_bytes`).

Driving it is the `Replica` protocol (replica.py), as for every wrapper; `optimizer.step()`
updates the shards only: the next forward gathers the new values.

A parameter used by modules of two units (tied input and output embeddings) is moved to
the root unit: it must be whole whenever either user runs, and the root unit is gathered
for the whole forward and backward.

Frozen parameters (a LoRA run's base, parallel/lora.py) are sharded and gathered with their
unit, in a flat buffer of their own (`FlatUnit.frozen`, or a unit that does not train), but
get no gradient hook, no reduce-scatter, no master copy and no optimizer state: a unit's
reduce-scatter carries its adapters' gradients only. They are freed once the backward has
moved past their unit, since no gradient of theirs says when their own backward ended.

Under expert parallelism two wrappers hold one module (a `ParamShare` each): the dense
one gathers the plan's units less the experts over dp, the other each layer's experts
(their own units) over expert_dp; each wrapper's hooks gather, prefetch, free and
reduce its own units, nested inside the other's (train/experts.py).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from paratrain import comm
from paratrain.comm import compat
from paratrain.parallel.data_parallel.adamw import ShardedAdamW
from paratrain.parallel.data_parallel.flat_buffer import FlatShard
from paratrain.parallel.data_parallel.fsdp_units import Event, FlatUnit, GatheredBytes, build_units
from paratrain.parallel.data_parallel.hybrid import HybridGroups
from paratrain.parallel.data_parallel.memory_count import count_memory
from paratrain.parallel.data_parallel.param_share import EVERY_PARAMETER, ParamShare
from paratrain.parallel.data_parallel.replica import MemoryReport
from paratrain.parallel.data_parallel.sharded_muon import ShardedMuon
from paratrain.parallel.data_parallel.sharded_replica import ShardedReplica
from paratrain.parallel.data_parallel.wrapper import broadcast_parameters
from paratrain.parallel.mixed_precision import DynamicLossScaler, MixedPrecision, scale_backward


class FullyShardedDataParallel(ShardedReplica):
    """ZeRO-3 of `module` over `group`, gathering by the given units (module names each).

    units: lists of module names, in forward order; parameters in none of them form a
        root unit, gathered at the start of forward and kept until its gradients arrive.
    prefetch: how many units ahead to gather while the current one computes.
    share: which of the module's parameters it holds (param_share.py): under expert
        parallelism one wrapper holds the dense parameters by the plan's units, another
        the experts by units of their own, each sharded over its own group.
    hybrid: HSDP (hybrid.py): shard over `hybrid.shard`, a part of `group`, and all-reduce
        the reduced shards over `hybrid.replicate`; `group` stays every rank holding it.
    """

    def __init__(
        self,
        module: nn.Module,
        group: comm.CommGroup,
        units: Sequence[Sequence[str]],
        precision: MixedPrecision | None = None,
        prefetch: int = 1,
        reduce_op: str = "sum",
        share: ParamShare = EVERY_PARAMETER,
        hybrid: HybridGroups | None = None,
    ) -> None:
        super().__init__()
        if prefetch < 0 or reduce_op not in ("avg", "sum"):
            raise ValueError(f"prefetch {prefetch} (>= 0) / reduce_op {reduce_op!r}")
        self.module, self.group, self.prefetch, self.reduce_op = module, group, prefetch, reduce_op
        self.hybrid = hybrid
        self.precision, self.share = precision or MixedPrecision(), share
        broadcast_parameters(module, group, share)
        self.tracker = GatheredBytes()
        self.events: list[Event] = []  # (kind, unit, ...) in order: gathers, forward ends
        # The share's parameters, and its frozen ones, gathered alike (no gradient)
        mine = share.named(module) + share.frozen(module)
        self.units = build_units(
            module, units, mine, self.shard_group, self.precision, self.tracker
        )
        self._unit_of = {id(p): u for u in self.units for p in u.params}
        for u in self.units:
            for p in u.params if u.trains else ():
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
            for m in u.modules:
                m.register_forward_pre_hook(lambda _m, _a, u=u: self._before_forward(u))
                m.register_forward_hook(lambda m, _a, out, u=u: self._after_forward(u, m, out))
        # Gradients complete in backward order: reduce-scatter in that order on every rank,
        # the root unit (if any) last.
        trained = [u for u in self.units if u.trains]  # a frozen unit has nothing to reduce
        self._reduce_order = [u for u in reversed(trained) if u.modules]
        self._reduce_order += [u for u in trained if not u.modules]
        self._next_reduce, self._flush_queued = 0, False
        self._pending: list[tuple[FlatUnit, Any, torch.Tensor]] = []
        self.scaler = None
        if self.precision.needs_loss_scaling:
            mp = self.precision
            self.scaler = DynamicLossScaler(mp.initial_loss_scale, mp.growth_interval)

    # -- gathering -------------------------------------------------------------------------
    def _before_forward(self, u: FlatUnit) -> None:
        if not u.gathered:
            u.wait()
            for v in self.units[u.index + 1 : u.index + 1 + self.prefetch]:
                v.gather(self.events, "forward")

    def _after_forward(self, u: FlatUnit, m: nn.Module, out: Any) -> None:
        if m is u.modules[-1]:
            self.events.append(("forward_end", u.index, time.perf_counter()))
            u.free()
        if torch.is_grad_enabled():
            for t in out if isinstance(out, tuple | list) else (out,):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda grad, u=u: self._before_backward(u))
                    u.in_backward = True  # a frozen unit fed by token ids never is

    def _before_backward(self, u: FlatUnit) -> None:
        if not u.gathered:
            u.wait()
            lower = max(0, u.index - self.prefetch)
            for v in reversed(self.units[lower : u.index]):
                if v.modules and v.in_backward:
                    v.gather(self.events, "backward")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        root = [u for u in self.units if not u.modules]
        for u in root:
            u.wait()
        out = self.module(*args, **kwargs)
        return scale_backward(out, self.scaler.scale) if self.scaler is not None else out

    # -- gradients -------------------------------------------------------------------------
    def _on_grad_ready(self, p: torch.Tensor) -> None:
        u = self._unit_of[id(p)]
        if u.grad_buffer is None:
            dtype = self.precision.param_dtype
            u.grad_buffer = u.shard.grad.new_zeros(u.layout.padded, dtype=dtype)
        i = next(j for j, q in enumerate(u.params) if q is p)
        seg = u.layout.segments[i]
        assert p.grad is not None
        u.grad_buffer[seg.start : seg.end].add_(p.grad.view(-1))
        p.grad = None
        u.ready.add(i)
        if not self._flush_queued:  # each backward ends with every unit reduced
            self._flush_queued = True
            compat.queue_backward_callback(self._flush)
        self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        while self._next_reduce < len(self._reduce_order):
            u = self._reduce_order[self._next_reduce]
            if not (force or len(u.ready) == len(u.params)):
                break
            # Its trainable parameters' backward is over, not necessarily that of its frozen
            # ones (a frozen base's input gradient may come after its adapters' gradients,
            # and no gradient of its own says when); every unit after it is done, though:
            # its gradients needed theirs.
            u.free(keep_frozen=True)
            for v in self.units[u.index + 1 :] if u.modules else ():
                v.free()
            self._launch(u)
            self._next_reduce += 1
        while self._pending and self._pending[0][1].is_completed():
            self._complete(*self._pending.pop(0))

    def _launch(self, u: FlatUnit) -> None:
        data, u.grad_buffer = u.grad_buffer, None
        if data is None:  # no gradient reached this unit in this backward
            data = u.shard.grad.new_zeros(u.layout.padded, dtype=self.precision.param_dtype)
        send = data.to(self.precision.reduce_dtype)
        sizes = [u.layout.shard] * self.shard_group.size
        handle = comm.reduce_scatter(
            send, self.shard_group, self.reduce_op, sizes=sizes, async_op=True
        )
        self._pending.append((u, handle, send))
        u.ready.clear()

    def _complete(self, u: FlatUnit, handle: Any, send: torch.Tensor) -> None:
        u.shard.grad.add_(handle.wait())

    def _flush(self) -> None:
        """End of a backward: reduce what is left, wait for everything, free everything."""
        self._flush_queued = False
        self._launch_ready(force=True)
        while self._pending:
            self._complete(*self._pending.pop(0))
        self._next_reduce = 0
        for u in self.units:
            u.free()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accepted for the common interface; ZeRO-3 reduces after every backward anyway."""
        yield

    @contextlib.contextmanager
    def one_backward(self) -> Iterator[None]:
        """Accepted for the common interface: ZeRO-3 runs in no pipeline (validate refuses
        it), so no weight pass is split into calls."""
        yield

    def finish_gradient_sync(self) -> None:
        """Everything was reduced within the shard group at the end of each backward; free
        what is left, and under HSDP all-reduce the shards across the replicas."""
        for u in self.units:
            u.free()
        self._all_reduce_across_replicas()

    def zero_grad(self, set_to_none: bool = False) -> None:
        del set_to_none
        for u in self.units:
            u.shard.grad.zero_()
            u.grad_buffer = None
        self.events.clear()
        self.tracker.reset_peak()

    # -- update and state ------------------------------------------------------------------
    @property
    def shards(self) -> list[FlatShard]:
        return [u.shard for u in self.units if u.trains]

    @property
    def frozen_shards(self) -> list[FlatShard]:
        return [u.shard for u in self.frozen_units]

    @property
    def frozen_units(self) -> list[FlatUnit]:
        """The flat buffers of frozen parameters: units that do not train, companions."""
        return [v for u in self.units for v in (u, u.frozen) if v is not None and not v.trains]

    @property
    def sharded_over(self) -> comm.CommGroup:
        return self.shard_group

    def _after_update(self) -> None:
        """Drop any gathered copy: the next forward gathers the updated shards."""
        for unit in self.units:
            unit.free()

    @property
    def peak_gathered_bytes(self) -> int:
        """The most bytes of gathered parameters alive at once since zero_grad()."""
        return self.tracker.peak

    def memory_report(self, optimizer: ShardedAdamW | ShardedMuon | None = None) -> MemoryReport:
        known: list[tuple[str, torch.Tensor]] = []
        for u in [*self.units, *(u.frozen for u in self.units if u.frozen is not None)]:
            known += [("params", u.shard.param), ("grads", u.shard.grad), ("params", u.full)]
            if u.shard.master is not None:
                known.append(("master", u.shard.master))
        k, p = self.shard_group.size, self.precision

        def beyond(units: list[FlatUnit]) -> int:  # elements beyond ceil(N/k) of them
            return sum(u.layout.shard for u in units) - -(-sum(u.layout.numel for u in units) // k)

        extra = beyond([u for u in self.units if u.trains])
        frozen = beyond(self.frozen_units)  # parameters only: no gradient, master or moments
        padding = {"params": (extra + frozen) * p.param_bytes, "grads": extra * p.param_bytes}
        # AdamW's moments cover the whole shard; Muon's AdamW skips the padding
        padding["optimizer"] = extra * 8 if isinstance(optimizer, ShardedAdamW) else 0
        if p.has_master:
            padding["master"] = extra * 4
        states = optimizer.states if optimizer is not None else ()
        whole = self.module if self.share.names is None else None  # else count the share
        return count_memory(known, padding, whole, states)

    def materialize(self) -> None:
        """Gather every unit and keep it: the plain module is whole again (after training;
        a collective). Until then a freed parameter's storage is empty, and reading it
        through `module.state_dict()` would read freed memory."""
        for u in self.units:
            u.wait()
