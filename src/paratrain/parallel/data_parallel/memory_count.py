"""A wrapper's `memory()` answer: the bytes it holds by category, each storage once."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from paratrain.comm.compat import storage_id
from paratrain.parallel.data_parallel.replica import MOMENTS, MUON_MOMENTUM, MemoryReport


def count_memory(
    known: Sequence[tuple[str, torch.Tensor | None]],
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
        if storage.nbytes() == 0 or storage_id(t) in seen:
            return
        seen.add(storage_id(t))
        totals[kind] += storage.nbytes()

    for kind, t in known:
        add(kind, t)
    for state in optimizer_states:
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                add("optimizer" if key in (*MOMENTS, MUON_MOMENTUM) else "other", value)
    for p in module.parameters() if module is not None else ():
        add("other", p.data)
        add("other", p.grad)
    for b in module.buffers() if module is not None else ():
        add("other", b)
    for kind, nbytes in padding.items():
        totals[kind] -= nbytes
    return MemoryReport(padding=sum(padding.values()), **totals)
