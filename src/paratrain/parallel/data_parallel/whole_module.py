"""The `Replica` protocol's gradient and checkpoint answers for a module held whole, its
gradients in `p.grad`: DataParallel's replica, and what the parameter server clips and
checkpoints (the flat-shard half: sharded_replica.py)."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

import torch
from torch import nn

from paratrain.comm.group import CommGroup
from paratrain.parallel.data_parallel.grad_lists import (
    all_reduce_in_place,
    scale_,
    squared_norms,
)
from paratrain.parallel.data_parallel.muon import WholeMuon
from paratrain.parallel.data_parallel.replica import MOMENTS, MUON_MOMENTUM, GradSquares, StatePiece


class WholeGradients:
    """The gradient and checkpoint parts of the protocol for a module held whole, its
    gradients in `p.grad`: what DataParallel does with its replica's, and what the
    parameter server needs to clip the gradients a worker pushed and to checkpoint."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def grad_squares(self) -> GradSquares:
        return whole_grad_squares(self.module.named_parameters(), device_of(self.module))

    def scale_grads_(self, factor: float) -> None:
        scale_whole_grads_(self.module.named_parameters(), factor)

    def checkpoint_pieces(
        self, optimizer: torch.optim.Optimizer
    ) -> tuple[list[StatePiece], list[torch.Tensor]]:
        return whole_checkpoint_pieces(self.module, optimizer)

    def after_load(self) -> None:
        """The whole values were loaded: nothing else holds a copy."""


Named = Iterable[tuple[str, nn.Parameter]]


def whole_grads(named: Named) -> tuple[list[str], list[torch.Tensor]]:
    """Names and gradients of the parameters in `named` that have one."""
    names, grads = [], []
    for name, p in named:
        if p.grad is not None:
            names.append(name)
            grads.append(p.grad)  # holds no autograd history: nothing to detach
    return names, grads


def device_of(module: nn.Module) -> torch.device:
    """Where a module's parameters live (the first one's device: a replica has one)."""
    return next(module.parameters()).device


def whole_grad_squares(
    named: Named, device: torch.device, split_over: CommGroup | None = None
) -> GradSquares:
    """Per-parameter squared norms of whole gradients held in `p.grad`."""
    names, grads = whole_grads(named)
    return GradSquares(names, squared_norms(grads, device), None, split_over)


def scale_whole_grads_(named: Named, factor: float) -> None:
    scale_(whole_grads(named)[1], factor)


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
    all_reduce_in_place([p.grad for p in params if p.grad is not None], group)  # all of them


def whole_checkpoint_pieces(
    module: nn.Module,
    optimizer: torch.optim.Optimizer | WholeMuon,
    only: Collection[str] | None = None,
) -> tuple[list[StatePiece], list[torch.Tensor]]:
    """`Replica.checkpoint_pieces` of a module held whole under torch's AdamW (or Muon and
    AdamW): each parameter that trains (of `only`, if given) is one piece, [0, numel), with its
    moments (a Muon matrix: its momentum); and AdamW's step counters."""
    pieces, counters = [], []
    for name, p in module.named_parameters():
        if (only is not None and name not in only) or not p.requires_grad:
            continue  # another wrapper's, or frozen (checkpoint/state.py saves it whole)
        if isinstance(optimizer, WholeMuon) and p in optimizer.momentum:
            moments = {MUON_MOMENTUM: optimizer.momentum[p]}
        elif isinstance(optimizer, torch.optim.SGD):  # plain SGD (sgd.py): no state
            moments = {}
        else:
            adam = optimizer.adamw if isinstance(optimizer, WholeMuon) else optimizer
            state = adam_state(adam, p)
            counters.append(state["step"])
            moments = {k: state[k] for k in MOMENTS}
        tensors = {"model": p.data.view(-1)} | {k: v.view(-1) for k, v in moments.items()}
        pieces.append(StatePiece(name, p.shape, 0, p.numel(), tensors))
    return pieces, counters


def complete_state_dict(
    module: nn.Module, values: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """`values` (one tensor per parameter, under named_parameters()' first name, and
    possibly persistent buffers) extended to every key of `module.state_dict()`: a tied
    parameter's other names alias its value, and buffers and frozen parameters not in
    `values` (held whole outside a wrapper) are copied from the module, so
    `load_state_dict(strict=True)` works."""
    canonical = {id(p): name for name, p in module.named_parameters()}
    out = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        held = isinstance(tensor, nn.Parameter) and canonical.get(id(tensor)) in values
        if held or (isinstance(tensor, nn.Parameter) and tensor.requires_grad):
            out[name] = values[canonical[id(tensor)]]
        else:
            out[name] = values[name] if name in values else tensor.detach().clone()
    return out


def adam_state(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> dict[str, torch.Tensor]:
    """AdamW's state of `param`, created (zeros, step 0) if no step has run yet, so that a
    checkpoint can be loaded into a freshly built optimizer."""
    state: dict[str, torch.Tensor] = optimizer.state[param]
    if not state:
        # Where torch's AdamW keeps it: on the host, or beside the parameter when fused.
        fused = bool(optimizer.defaults.get("fused")) or bool(optimizer.defaults.get("capturable"))
        host = torch.device("cpu")  # host-side counter, as torch's AdamW keeps it unfused
        state["step"] = torch.zeros((), device=param.device if fused else host)
        for key in MOMENTS:
            state[key] = torch.zeros_like(param, memory_format=torch.preserve_format)
    return state
