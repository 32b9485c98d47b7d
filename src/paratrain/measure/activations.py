"""Activation memory measured with saved-tensor hooks, not computed from a formula.

Autograd calls the pack hook for every tensor a forward saves for backward. The meter sums
their bytes, counting each storage once (views of one tensor share it) and leaving out the
parameters (model state, not activations). Forward hooks on chosen modules attribute each
saved tensor to the innermost of them that is running, so a per-block breakdown falls out.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn


class ActivationMeter:
    """Use as `with ActivationMeter(model, {"block 0": model.blocks["0"], ...}) as m:`."""

    def __init__(self, model: nn.Module, regions: dict[str, nn.Module] | None = None) -> None:
        self.param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.regions = regions or {}
        self.by_region: dict[str, int] = defaultdict(int)
        self.total = 0
        self.storages: dict[int, int] = {}  # data_ptr -> bytes of each storage counted
        self._stack: list[str] = []
        self._handles: list[Any] = []
        self._hooks: Any = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.param_storages and ptr not in self.storages:
            nbytes = storage.nbytes()
            self.storages[ptr] = nbytes
            self.total += nbytes
            self.by_region[self._stack[-1] if self._stack else "other"] += nbytes
        # Detached: a saved output returned with its grad_fn would hold that grad_fn, which
        # holds it, a cycle through C++ that no collector frees once a graph is retained
        # (ZB-H1's input pass): each step's graphs stayed. Autograd reattaches it.
        return t.detach()

    def _enter_region(self, name: str) -> Any:
        def hook(_module: nn.Module, _args: Any) -> None:
            self._stack.append(name)

        return hook

    def _leave_region(self, _module: nn.Module, _args: Any, _output: Any) -> None:
        self._stack.pop()  # returns None: a forward hook's return value replaces the output

    def __enter__(self) -> ActivationMeter:
        for name, module in self.regions.items():
            self._handles.append(module.register_forward_pre_hook(self._enter_region(name)))
            self._handles.append(module.register_forward_hook(self._leave_region))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
