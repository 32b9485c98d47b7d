"""Every torch name that is private, or not in every supported release, with its fallback.

Supported: torch 2.11.0 up to 2.14.1 (pyproject.toml), checked on 2.11.0, 2.13.0 and
2.14.1 (`make test-torch-2.11.0`, `make test-torch-2.14.1`). No other file of the package
touches a private torch name or one that came or went within that range: a new release
changes this file only.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

# The single-tensor all-gather and reduce-scatter were renamed in torch 2.13
# (`all_gather_single`, `reduce_scatter_single`); 2.11 and 2.12 know only the old names,
# which 2.13 and 2.14 still accept.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def foreach_norm(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's 2-norm in one fused call (torch._foreach_norm: private, in every
    supported release)."""
    return list(torch._foreach_norm(tensors))


def foreach_mul_(tensors: list[torch.Tensor], factor: Any) -> None:
    torch._foreach_mul_(tensors, factor)


def default_store() -> dist.Store:
    """The default group's rendezvous store (private in every supported release)."""
    return dist.distributed_c10d._get_default_store()


# Selective activation checkpointing's cache (torch.utils.checkpoint, private): a dict
# from op to that op's entries in call order, a list that recomputation pops from (2.11,
# 2.12) or a dict of call index -> entry that it marks consumed (2.13 on). Each kept output
# is a tree of wrappers whose `val` is the detached tensor (the same storage).


def sac_kept_tensors(storage: dict) -> list[torch.Tensor]:
    """The tensors a selective checkpoint's forward kept in its cache."""
    from torch.utils._pytree import tree_leaves

    kept = []
    for calls in storage.values():
        for entry in calls.values() if isinstance(calls, dict) else calls:
            for leaf in tree_leaves(entry):
                value = getattr(leaf, "val", None)
                if isinstance(value, torch.Tensor):
                    kept.append(value)
    return kept


def sac_snapshot(storage: dict) -> dict:
    """The cache's entries as they are now, to put back after a recomputation took them."""
    return {op: copy.copy(calls) for op, calls in storage.items()}


def sac_restore(storage: dict, snapshot: dict) -> None:
    storage.update({op: copy.copy(calls) for op, calls in snapshot.items()})


def graph_exec_group() -> Any:
    """torch.utils.checkpoint.GraphExecGroup (public since 2.11, not exported before):
    backward calls inside it share one recomputation of a checkpointed region."""
    from torch.utils.checkpoint import GraphExecGroup

    return GraphExecGroup()
