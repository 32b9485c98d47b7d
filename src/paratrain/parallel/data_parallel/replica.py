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

import contextlib
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from paratrain.comm.group import CommGroup
from paratrain.parallel.data_parallel.muon_math import MuonSettings
from paratrain.parallel.mixed_precision import DynamicLossScaler

MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's state tensors, shaped like the parameter
MUON_MOMENTUM = "momentum_buffer"  # Muon's (torch.optim.Muon's name), shaped like its matrix


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


class Checkpointed(Protocol):
    """What a checkpoint reads of a replica, or of a module held whole (WholeGradients)."""

    module: nn.Module

    def checkpoint_pieces(self, optimizer: Any) -> tuple[list[StatePiece], list[torch.Tensor]]:
        """This rank's pieces of every parameter and moment, and AdamW's step counters."""
        ...


class ScalesGradients(Protocol):
    """What clipping needs of a replica, or of a module held whole (WholeGradients)."""

    def scale_grads_(self, factor: float) -> None: ...


@runtime_checkable
class Replica(Protocol):
    """What every data-parallel wrapper of `module` over `group` answers."""

    module: nn.Module
    group: CommGroup
    scaler: DynamicLossScaler | None  # fp16's loss scaler, else None

    training: bool  # every wrapper is an nn.Module: train() and eval() switch it

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def train(self, mode: bool = True) -> Any: ...

    def eval(self) -> Any: ...

    def no_sync(self) -> AbstractContextManager[None]:
        """Accumulate this backward's gradients without reducing them yet."""
        ...

    def one_backward(self) -> AbstractContextManager[None]:
        """Several autograd calls are one micro-batch's backward (a zero-bubble schedule's
        weight pass: one call per weight group): what the wrapper does at the end of a
        backward waits for the last of them."""
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
        self,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        eps: float = 1e-8,
        muon: MuonSettings | None = None,
        tp: CommGroup | None = None,
        sgd: bool = False,
    ) -> Any:
        """AdamW over what this rank updates (with `muon`, Muon over the plan's matrices and
        AdamW over the rest; `tp`: the group the matrices are split over; with `sgd`, plain
        SGD instead: sgd.py); driven as `param_groups[i]["lr"]`, `step()`."""
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


@contextlib.contextmanager
def one_backward(wrappers: Sequence[Replica]) -> Iterator[None]:
    """Every wrapper's `one_backward`, entered together (a pipeline stage's replicas)."""
    with contextlib.ExitStack() as stack:
        for w in wrappers:
            stack.enter_context(w.one_backward())
        yield
