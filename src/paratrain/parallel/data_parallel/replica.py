"""The one protocol every data-parallel wrapper answers, and the pieces of its answers.

A training step treats `DataParallel`, `ZeroDataParallel` (ZeRO 0-2) and
`FullyShardedDataParallel` (ZeRO-3) alike: it asks a `Replica` to run forward, to hold back
or finish the gradient reduction, to scale its reduced gradient, for this rank's squared
gradient norms, to sum some gradients over another group (sequence parallelism, tied
weights across pipeline stages), for an optimizer over what it owns, for its memory, and
for the pieces of state a checkpoint stores. Each wrapper keeps its gradients where it
likes (`p.grad`, flat shards); only its own methods look there. Adding a wrapper means
implementing this protocol, not adding a branch to the training step.

A wrapper holds every parameter of its module, or the `ParamShare` it is given: under
expert parallelism two wrappers share one module, the experts reduced over the expert-dp
group and the rest over dp (train/experts.py).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from paratrain import comm
from paratrain.comm import compat
from paratrain.comm.group import CommGroup
from paratrain.parallel.mixed_precision import DynamicLossScaler

MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's state tensors, shaped like the parameter


@dataclass(frozen=True)
class GradSquares:
    """This rank's squared L2 norm of each gradient entry it holds.

    names[i]: the parameter (as named in the replica's module) entry i belongs to; a
        parameter cut across dp ranks appears once per piece held here.
    squares: (len(names),) float64.
    sharded_over: the group whose ranks hold disjoint pieces of these gradients (their
        squares add up), or None when every rank of the replica's group holds all of them.
    split_over: the group whose ranks hold different parameters under these names (expert
        parallelism: each rank of an ep group its own experts), so their squares add too.
    """

    names: list[str]
    squares: torch.Tensor
    sharded_over: CommGroup | None
    split_over: CommGroup | None = None  # ranks holding different parameters (experts over ep)


@dataclass(frozen=True)
class StatePiece:
    """Flattened elements [lo, hi) of one parameter that this rank holds, with its AdamW
    moments: what a sharded checkpoint stores of it from this rank.

    shape: the parameter's shape in the replica's module (tensor-parallel shards are
        placed in the global tensor by the checkpoint code).
    tensors: "model", "exp_avg", "exp_avg_sq" -> (hi - lo,) views of live storage, so that
        saving reads the training state and loading writes into it in place.
    """

    name: str
    shape: torch.Size
    lo: int
    hi: int
    tensors: dict[str, torch.Tensor]


@dataclass(frozen=True)
class MemoryReport:
    """Bytes of unique storage on one rank at the step boundary, by kind.

    padding: elements added so shards are equal, beyond what the planner's formula
    (plan/memory.py, one buffer padded to a multiple of k) already counts.
    other: storage reachable from the model or optimizer that is none of the above, e.g.
    AdamW's per-tensor step counters.
    """

    params: int
    grads: int
    master: int
    optimizer: int
    padding: int
    other: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.master + self.optimizer + self.padding + self.other

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


@runtime_checkable
class Replica(Protocol):
    """What every data-parallel wrapper of `module` over `group` answers."""

    module: nn.Module
    group: CommGroup
    scaler: DynamicLossScaler | None  # fp16's loss scaler, else None

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def no_sync(self) -> AbstractContextManager[None]:
        """Accumulate this backward's gradients without reducing them yet."""
        ...

    def finish_gradient_sync(self) -> None:
        """After the last backward: reduce what is left and wait for every reduction."""
        ...

    def zero_grad(self, set_to_none: bool = False) -> None: ...

    def scale_grads_(self, factor: float) -> None:
        """Multiply the reduced gradient by `factor`, wherever it is kept."""
        ...

    def grad_squares(self) -> GradSquares: ...

    def all_reduce_grads_(
        self, names: Sequence[str], group: CommGroup, same_layout: bool = True
    ) -> None:
        """Sum over `group` the reduced gradients of the named parameters, in place.

        Collective over `group`, whose ranks name parameters of the same shapes in the same
        order. same_layout: they are tensor-parallel peers, holding the same pieces (a
        sharded wrapper sums its pieces); False: they may shard them differently (tied
        weights at the two ends of a pipeline), so the sum goes through whole tensors.
        """
        ...

    def build_optimizer(
        self, lr: float, weight_decay: float, betas: tuple[float, float], eps: float = 1e-8
    ) -> Any:
        """AdamW over what this rank updates; driven as `param_groups[i]["lr"]`, `step()`."""
        ...

    def memory_report(self, optimizer: Any = None) -> MemoryReport: ...

    def checkpoint_pieces(self, optimizer: Any) -> tuple[list[StatePiece], list[torch.Tensor]]:
        """This rank's pieces of every parameter and moment, and AdamW's step counters."""
        ...

    def after_load(self) -> None:
        """Make every copy agree with values just loaded into the pieces (collective)."""
        ...

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every key of the module's state_dict(), tied aliases included, whole (fp32
        master values where they exist), on every rank (collective)."""
        ...

    def materialize(self) -> None:
        """After training: leave the module whole and usable on its own (collective)."""
        ...


class WholeGradients:
    """The gradient and checkpoint parts of the protocol for a module held whole, its
    gradients in `p.grad`: what DataParallel does with its replica's, and what the
    parameter server needs to clip the gradients a worker pushed and to checkpoint."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def grad_squares(self) -> GradSquares:
        return whole_grad_squares(self.module)

    def scale_grads_(self, factor: float) -> None:
        scale_whole_grads_(self.module, factor)

    def checkpoint_pieces(
        self, optimizer: torch.optim.Optimizer
    ) -> tuple[list[StatePiece], list[torch.Tensor]]:
        return whole_checkpoint_pieces(self.module, optimizer)

    def after_load(self) -> None:
        """The whole values were loaded: nothing else holds a copy."""


def whole_grads(
    module: nn.Module, only: Collection[str] | None = None
) -> tuple[list[str], list[torch.Tensor]]:
    """Names and gradients of the parameters that have one (each parameter once); with
    `only`, of those named there (a wrapper holding some of the module's parameters)."""
    names, grads = [], []
    for name, p in module.named_parameters():
        if p.grad is not None and (only is None or name in only):
            names.append(name)
            grads.append(p.grad.detach())
    return names, grads


def device_of(module: nn.Module) -> torch.device:
    """Where a module's parameters live (the first one's device: a replica has one)."""
    return next(module.parameters()).device


def squared_norms(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """(len(tensors),) float64: each tensor's squared L2 norm. Norms are taken per tensor
    in its own dtype (one fused kernel per dtype, as torch.nn.utils.clip_grad_norm_ does;
    one fp32 norm over a whole flat buffer rounds measurably worse), float16's in float32
    (a float16 norm above 65504 is inf though every entry is finite: the step would be
    skipped as an overflow), then squared in float64."""
    if not tensors:
        return torch.zeros(0, dtype=torch.float64, device=device)
    norms: dict[int, torch.Tensor] = {}  # index -> its norm
    for dtype in {t.dtype for t in tensors}:  # one fused call per dtype
        where = [i for i, t in enumerate(tensors) if t.dtype == dtype]
        wide = torch.float32 if dtype == torch.float16 else None
        found = compat.foreach_norm([tensors[i] for i in where], wide)
        norms.update(zip(where, found, strict=True))
    return torch.stack([norms[i].double() for i in range(len(tensors))]).pow(2)


def scale_(tensors: list[torch.Tensor], factor: float) -> None:
    if tensors and factor != 1.0:
        compat.foreach_mul_(tensors, factor)


def all_reduce_in_place(tensors: list[torch.Tensor], group: CommGroup) -> None:
    """Sum `tensors` over `group` in one call (flattened end to end), each in place."""
    dtype = tensors[0].dtype if tensors else torch.float32
    if not tensors:  # still a call: the other ranks of the group may hold some
        flat = torch.zeros(0, dtype=dtype, device=group.device)
    else:
        flat = torch.cat([t.reshape(-1) for t in tensors])
    comm.all_reduce(flat, group, op="sum")
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def whole_grad_squares(
    module: nn.Module, only: Collection[str] | None = None, split_over: CommGroup | None = None
) -> GradSquares:
    """Per-parameter squared norms of whole gradients held in `p.grad`."""
    names, grads = whole_grads(module, only)
    return GradSquares(names, squared_norms(grads, device_of(module)), None, split_over)


def scale_whole_grads_(
    module: nn.Module, factor: float, only: Collection[str] | None = None
) -> None:
    scale_(whole_grads(module, only)[1], factor)


def all_reduce_whole_grads_(module: nn.Module, names: Sequence[str], group: CommGroup) -> None:
    """`Replica.all_reduce_grads_` for gradients kept whole in `p.grad`, concatenated in
    the order of `names` (in place; a parameter without a gradient contributes zeros,
    since other ranks may have one)."""
    named = dict(module.named_parameters())
    params = [named[n] for n in names if n in named and named[n].requires_grad]
    if group.size == 1 or not params:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    all_reduce_in_place([p.grad for p in params], group)


def whole_checkpoint_pieces(
    module: nn.Module, optimizer: torch.optim.Optimizer, only: Collection[str] | None = None
) -> tuple[list[StatePiece], list[torch.Tensor]]:
    """`Replica.checkpoint_pieces` of a module held whole under torch's AdamW: each
    parameter (of `only`, if given) is one piece, [0, numel), with its moments; and
    AdamW's step counters."""
    pieces, counters = [], []
    for name, p in module.named_parameters():
        if only is not None and name not in only:
            continue
        state = adam_state(optimizer, p)
        counters.append(state["step"])
        tensors = {"model": p.data.view(-1)} | {k: state[k].view(-1) for k in MOMENTS}
        pieces.append(StatePiece(name, p.shape, 0, p.numel(), tensors))
    return pieces, counters


def complete_state_dict(
    module: nn.Module, values: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """`values` (one tensor per parameter, under named_parameters()' first name, and
    possibly persistent buffers) extended to every key of `module.state_dict()`: a tied
    parameter's other names alias its value, and buffers not in `values` are copied from
    the module, so `load_state_dict(strict=True)` works."""
    canonical = {id(p): name for name, p in module.named_parameters()}
    out = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        if isinstance(tensor, nn.Parameter) and id(tensor) in canonical:
            out[name] = values[canonical[id(tensor)]]
        else:
            out[name] = values[name] if name in values else tensor.detach().clone()
    return out


def count_memory(
    known: list[tuple[str, torch.Tensor | None]],
    padding: dict[str, int],
    module: nn.Module | None,
    optimizer_states: Iterable[dict[str, Any]],
) -> MemoryReport:
    """Count each storage once: the wrapper's `known` buffers by category, the optimizer's
    moments, and anything else reachable from the module's parameters, gradients and
    buffers as `other` (module None: the caller listed everything in `known`). `padding`
    (bytes per category) is moved out into its own line."""
    seen: set[int] = set()
    totals = dict.fromkeys(("params", "grads", "master", "optimizer", "other"), 0)

    def add(kind: str, t: torch.Tensor | None) -> None:
        if t is None:
            return
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            return
        seen.add(storage.data_ptr())
        totals[kind] += storage.nbytes()

    for kind, t in known:
        add(kind, t)
    for state in optimizer_states:
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                add("optimizer" if key in MOMENTS else "other", value)
    for p in module.parameters() if module is not None else ():
        add("other", p.data)
        add("other", p.grad)
    for b in module.buffers() if module is not None else ():
        add("other", b)
    for kind, nbytes in padding.items():
        totals[kind] -= nbytes
    return MemoryReport(padding=sum(padding.values()), **totals)


def adam_state(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> dict[str, torch.Tensor]:
    """AdamW's state of `param`, created (zeros, step 0) if no step has run yet, so that a
    checkpoint can be loaded into a freshly built optimizer."""
    state = optimizer.state[param]
    if not state:
        # Where torch's AdamW keeps it: on the host, or beside the parameter when fused.
        fused = bool(optimizer.defaults.get("fused")) or bool(optimizer.defaults.get("capturable"))
        host = torch.device("cpu")  # host-side counter, as torch's AdamW keeps it unfused
        state["step"] = torch.zeros((), device=param.device if fused else host)
        for key in MOMENTS:
            state[key] = torch.zeros_like(param, memory_format=torch.preserve_format)
    return state
