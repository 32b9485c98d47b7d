"""FSDP units: which parameters are gathered together, and one unit's gather/free cycle.

A unit is a group of modules whose parameters are stored as one flat buffer sharded over
the dp group (FSDP, Zhao et al., arXiv:2304.11277, section 3.2.1: one FlatParameter per
FSDP unit). Its full parameters exist only between a gather and the next free: the
parameters keep their identity and shape (they are views of `full`), and freeing resizes
`full`'s storage to zero bytes, as FSDP does, so that views and the tensors autograd saved
for backward stay valid and see the values again once the storage is refilled.

Units are declared as data (models/plans.py: GPT_FSDP_UNITS): a tuple of module names per
unit, where a trailing ".*" expands to one unit per child, in order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.profiler import record_function

from paratrain import comm
from paratrain.comm.compat import same_memory
from paratrain.module_names import matching
from paratrain.parallel.data_parallel.flat_buffer import FlatLayout, FlatShard, make_shard
from paratrain.parallel.mixed_precision import MixedPrecision

# What FSDP records, in order: ("gather", unit, phase, ledger seq or None: done at once),
# ("forward_end", unit, perf_counter time).
Event = tuple[str, int, str, int | None] | tuple[str, int, float]

# The profiler range around each allocation of a unit's full parameters: with it,
# measure/allocator.py's `peak(scope=GATHER_SCOPE)` is the gathered memory FSDP holds.
GATHER_SCOPE = "fsdp.gather"


def expand_units(model: nn.Module, spec: Sequence[Sequence[str]]) -> list[list[str]]:
    """Module names per unit: a unit of one pattern (module_names.py) becomes one unit per
    module it matches ("blocks.*": one per block); modules that are None are skipped."""
    units: list[list[str]] = []
    for names in spec:
        if len(names) == 1 and "*" in names[0]:
            units += [[name] for name in matching(model, names[0])]
            continue
        present = [n for n in names if _has_module(model, n)]
        if present:
            units.append(present)
    return units


def _has_module(model: nn.Module, name: str) -> bool:
    try:
        return model.get_submodule(name) is not None
    except AttributeError:
        return False


class GatheredBytes:
    """Bytes of full parameters alive now (gathered, or being gathered), and the peak."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0

    def add(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def reset_peak(self) -> None:
        self.peak = self.live


class FlatUnit:
    """One unit's parameters: a sharded flat buffer, gathered on demand into `full`.

    trains False: frozen parameters (a LoRA run's base), gathered and freed like the rest
    but never given a gradient, a master copy or optimizer state. A unit with both holds
    its frozen ones in a `frozen` companion, gathered, awaited and freed with it.
    """

    def __init__(
        self,
        index: int,
        name: str,
        modules: list[nn.Module],
        named_params: list[tuple[str, nn.Parameter]],
        group: comm.CommGroup,
        precision: MixedPrecision,
        tracker: GatheredBytes,
        trains: bool = True,
    ) -> None:
        self.index, self.name, self.modules, self.trains = index, name, modules, trains
        self.in_backward = trains  # whether a backward ever runs through it: prefetch it
        self.frozen: FlatUnit | None = None
        self.params = [p for _, p in named_params]
        self.group, self.tracker = group, tracker
        self.layout = FlatLayout(named_params, group.size)
        values = torch.zeros(self.layout.padded, device=self.params[0].device)  # (padded,) fp32
        for p, view in zip(self.params, self.layout.views(values), strict=True):
            view.copy_(p.detach())
        lo, hi = self.layout.shard_range(group.rank)
        dtype = precision.param_dtype
        param_shard = values[lo:hi].to(dtype, copy=True)  # own storage: the rest is freed
        master = values[lo:hi] if precision.has_master and trains else None
        self.shard: FlatShard = make_shard(self.layout, group.rank, param_shard, dtype, master)
        if not trains:  # no gradient ever reaches it
            self.shard.grad = param_shard.new_zeros(0)
        self.full = param_shard.new_empty(self.layout.padded)  # (padded,) when gathered
        for p, view in zip(self.params, self.layout.views(self.full), strict=True):
            p.data = view
        self.nbytes = self.full.numel() * self.full.element_size()
        self.full.untyped_storage().resize_(0)
        self.gathered = False
        self.handle: Any = None  # a gather in flight
        self.ready: set[int] = set()  # params whose gradient arrived in this backward
        self.grad_buffer: torch.Tensor | None = None  # (padded,) full gradients, transient

    def gather(self, events: list[Event] | None = None, phase: str = "") -> None:
        """Issue the all-gather of this unit's shards (asynchronously) unless done already."""
        if self.frozen is not None:
            self.frozen.gather()  # recorded as the unit's one gather
        if self.gathered or self.handle is not None:
            return
        sizes = [self.layout.shard] * self.group.size
        with record_function(GATHER_SCOPE):
            self.full.untyped_storage().resize_(self.nbytes)
        # Received straight into the unit's storage: no receive buffer, no second copy.
        self.handle = comm.all_gather_flat(
            self.shard.param, self.group, sizes=sizes, async_op=True, out=self.full
        )
        self.tracker.add(self.nbytes)  # in flight or gathered: one unit of full parameters
        if events is not None:
            seq = self.handle.seq  # None for a gather already done
            events.append(("gather", self.index, phase, seq))

    def wait(self) -> None:
        """Make the full parameters available: finish (or issue and finish) the gather."""
        if self.frozen is not None:
            self.frozen.wait()
        if self.gathered:
            return
        self.gather()
        out = self.handle.wait()  # (padded,)
        self.handle = None
        assert same_memory(out, self.full)
        self.gathered = True

    def free(self, keep_frozen: bool = False) -> None:
        """Drop the full parameters; the shard stays. keep_frozen: not the frozen
        companion's (its backward may still be running: see FullyShardedDataParallel)."""
        if self.frozen is not None and not keep_frozen:
            self.frozen.free()
        if self.handle is not None:  # a prefetch that was never used
            self.wait()
        if self.gathered:
            self.full.untyped_storage().resize_(0)
            self.tracker.add(-self.nbytes)
            self.gathered = False


# One entry of the units' spec: its name, its modules, its (name, parameter) pairs.
_Entry = tuple[str, list[nn.Module], list[tuple[str, nn.Parameter]]]


def build_units(
    module: nn.Module,
    spec: Sequence[Sequence[str]],
    mine: Sequence[tuple[str, nn.Parameter]],
    group: comm.CommGroup,
    precision: MixedPrecision,
    tracker: GatheredBytes,
) -> list[FlatUnit]:
    """A unit per entry of `spec` (module names) holding the parameters of `mine` its
    modules use; parameters that no entry's modules use, or that the modules of two
    entries use (tied weights), form the root unit. Frozen parameters (requires_grad
    False) go to a unit's `frozen` companion, or form a unit that does not train."""
    ids = {id(p) for _, p in mine}
    found: list[_Entry] = []
    users: dict[int, int] = {}  # id(parameter) -> how many entries use it
    for names in spec:
        modules = [module.get_submodule(n) for n in names]
        named: dict[int, tuple[str, nn.Parameter]] = {}
        for n, m in zip(names, modules, strict=True):
            for pn, p in m.named_parameters(prefix=n):
                if id(p) in ids:
                    named.setdefault(id(p), (pn, p))
        found.append((",".join(names), modules, list(named.values())))
        for key in named:
            users[key] = users.get(key, 0) + 1
    entries: list[_Entry] = []
    claimed: set[int] = set()
    for name, modules, named_params in found:
        own = [(pn, p) for pn, p in named_params if users[id(p)] == 1]
        claimed.update(id(p) for _, p in own)
        # A module left with none of the unit's parameters (a tied head, an embedding
        # whose table went to the root) must not gather the unit for its passes.
        held = {id(p) for _, p in own}
        modules = [m for m in modules if any(id(p) in held for p in m.parameters())]
        if own:
            entries.append((name, modules, own))
    rest = [(n, p) for n, p in mine if id(p) not in claimed]
    if rest:
        entries.insert(0, ("<root>", [], rest))
    units: list[FlatUnit] = []
    for name, modules, pairs in entries:
        trained = [(n, p) for n, p in pairs if p.requires_grad]
        frozen = [(n, p) for n, p in pairs if not p.requires_grad]
        args = (group, precision, tracker)
        unit = FlatUnit(len(units), name, modules, trained or frozen, *args, trains=bool(trained))
        if trained and frozen:
            unit.frozen = FlatUnit(unit.index, name, modules, frozen, *args, trains=False)
        units.append(unit)
    return units
