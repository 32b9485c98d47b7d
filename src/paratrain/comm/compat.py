"""Every torch name that is private, or not in every supported release, with its fallback.

Supported: torch 2.11.0 up to 2.14.1 (pyproject.toml), checked on 2.11.0, 2.13.0 and
2.14.1 (`make test-torch-2.11.0`, `make test-torch-2.14.1`). No other file of the package
touches a private torch name or one that came or went within that range: a new release
changes this file only.
"""

from __future__ import annotations

import copy
import importlib
import os
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch._ops import HigherOrderOperator as HigherOrderOperator
from torch._subclasses.fake_tensor import FakeTensorMode as FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode as TorchDispatchMode

# The single-tensor all-gather and reduce-scatter were renamed in torch 2.13
# (`all_gather_single`, `reduce_scatter_single`); 2.11 and 2.12 know only the old names,
# which 2.13 and 2.14 still accept.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

P = ParamSpec("P")
R = TypeVar("R")


def graph_break(fn: Callable[P, R]) -> Callable[P, R]:
    """Under torch.compile, fn runs eagerly, between graphs. `torch._disable_dynamo`, not
    `torch.compiler.disable`: the latter imports torch._dynamo (0.8 s of CPU) at
    decoration, in every process that imports a seam; the former at fn's first call."""
    disabled: Callable[P, R] = torch._disable_dynamo(fn)
    return disabled


# torch's optimizers import torch._dynamo at construction: a forkserver preloads it for
# the ranks it forks (spawn.py). A break at a seam names `torch._disable_dynamo`'s file
# (2.11-2.14): what parallel/compile.py counts as a seam's break.
OPTIMIZER_IMPORTS = ("torch._dynamo",)
SEAM_BREAK = f"{os.sep}torch{os.sep}_compile.py"


def foreach_norm(
    tensors: list[torch.Tensor], dtype: torch.dtype | None = None
) -> list[torch.Tensor]:
    """Each tensor's 2-norm in one fused call, in `dtype` (None: each tensor's own)
    (torch._foreach_norm: private, in every supported release, with its dtype)."""
    return list(torch._foreach_norm(tensors, dtype=dtype))


def foreach_mul_(tensors: list[torch.Tensor], factor: Any) -> None:
    torch._foreach_mul_(tensors, factor)


def default_store() -> dist.Store:
    """The default group's rendezvous store (private in every supported release)."""
    return dist.distributed_c10d._get_default_store()


# Selective activation checkpointing's cache (torch.utils.checkpoint, private): a dict
# from op to that op's entries in call order, a list that recomputation pops from (2.11,
# 2.12) or a dict of call index -> entry that it marks consumed (2.13 on). Each kept output
# is a tree of wrappers whose `val` is the detached tensor (the same storage).
SacStorage = dict[Any, list[Any] | dict[int, Any]]


def sac_kept_tensors(storage: SacStorage) -> list[torch.Tensor]:
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


def sac_snapshot(storage: SacStorage) -> SacStorage:
    """The cache's entries as they are now, to put back after a recomputation took them."""
    return {op: copy.copy(calls) for op, calls in storage.items()}


def sac_restore(storage: SacStorage, snapshot: SacStorage) -> None:
    storage.update({op: copy.copy(calls) for op, calls in snapshot.items()})


def graph_exec_group() -> Any:
    """torch.utils.checkpoint.GraphExecGroup (public since 2.11, not exported before):
    backward calls inside it share one recomputation of a checkpointed region."""
    from torch.utils.checkpoint import GraphExecGroup

    return GraphExecGroup()


def queue_backward_callback(callback: Any) -> None:
    """Run `callback` once the current backward pass ends (the autograd engine's private
    queue, in every supported release; what DDP's reducer uses)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


# The base class of every dropout layer (Dropout, Dropout1d/2d/3d, AlphaDropout): private,
# in every supported release.
DropoutBase = nn.modules.dropout._DropoutNd  # a class: its `p` is typed

# Dispatcher-level interception, for counting a PyTorch peer's collectives (bench only):
# HigherOrderOperator (torch._ops) and TorchDispatchMode (torch.utils._python_dispatch),
# imported above; `import torch` loads both modules itself, so naming them costs nothing.
# --- heavy or rarely used: imported on first use -------------------------------------------


def dynamo_config() -> Any:
    """torch._dynamo.config (its import costs seconds: only --compile needs it). Its
    `recompile_limit` and `accumulated_recompile_limit` are named so in every supported
    release."""
    import torch._dynamo.config

    return torch._dynamo.config


def dynamo_counters() -> Any:
    """torch._dynamo.utils.counters: graph breaks by reason, frames compiled or not."""
    from torch._dynamo.utils import counters

    return counters


def inductor_config() -> Any:
    """torch._inductor.config (its `cpp.cxx`: the C++ compilers tried on the CPU)."""
    from torch._inductor import config

    return config


def inductor_compile_fx() -> Any:
    """Inductor's backend entry point, torch._inductor.compile_fx.compile_fx."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx


def profiler_event_kinds() -> tuple[Any, Any]:
    """(RecordScope, _EventType) of the profiler's event tree (torch._C._profiler)."""
    from torch._C._profiler import RecordScope, _EventType

    return RecordScope, _EventType


def context_parallel_unshard() -> Any:
    """PyTorch's own context parallelism's inverse of its sharding (a private module of an
    experimental package, in every supported release): the GPU benchmark's peer."""
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard

    return context_parallel_unshard


def _dropout_base_is_dropouts() -> None:
    if not issubclass(nn.Dropout, DropoutBase):
        raise TypeError(f"nn.Dropout is not a {DropoutBase}")


# What each name must provide on the installed torch: the attributes we read, resolved.
_CHECKS: dict[str, Any] = {
    "all_gather_single": lambda: all_gather_single,
    "reduce_scatter_single": lambda: reduce_scatter_single,
    "foreach_norm": lambda: foreach_norm([torch.ones(2, device="cpu")]),
    "foreach_mul_": lambda: foreach_mul_([torch.ones(2, device="cpu")], 2.0),
    "default_store": lambda: dist.distributed_c10d._get_default_store,
    "queue_backward_callback": lambda: torch.autograd.Variable._execution_engine.queue_callback,
    "DropoutBase": _dropout_base_is_dropouts,
    "graph_exec_group": graph_exec_group,
    "dynamo_config": lambda: (
        dynamo_config().recompile_limit,
        dynamo_config().accumulated_recompile_limit,
    ),
    "dynamo_counters": lambda: (dynamo_counters()["graph_break"], dynamo_counters()["frames"]),
    "inductor_config": lambda: inductor_config().cpp.cxx,
    "inductor_compile_fx": inductor_compile_fx,
    "profiler_event_kinds": lambda: (
        profiler_event_kinds()[0].USER_SCOPE,
        profiler_event_kinds()[1].Allocation,
        profiler_event_kinds()[1].TorchOp,
    ),
    "context_parallel_unshard": context_parallel_unshard,
    "total_flop_counter": lambda: _total_flops_counted(),
}


def missing() -> list[str]:
    """Every name here the installed torch cannot give, as "name: error" (test_compat.py,
    gpu-check.sh); the selective checkpoint cache's layout is checked by test_recompute."""
    problems = []
    for name, check in _CHECKS.items():
        try:
            check()
        except Exception as e:  # whatever the failure, it is this name's report
            problems.append(f"{name}: {type(e).__name__}: {e}")
    return problems


def launch_shutdown_timeout(seconds: int) -> dict[str, Any]:
    """LaunchConfig's `shutdown_timeout` where it exists (torch 2.13+; 2.11, 2.12: 30 s)."""
    from torch.distributed.launcher.api import LaunchConfig

    known = LaunchConfig.__dataclass_fields__
    return {"shutdown_timeout": seconds} if "shutdown_timeout" in known else {}


def storage_id(t: torch.Tensor) -> int:
    """Which storage a tensor's memory is: the storage object's own address (private
    `_cdata`, in every supported release). Not `data_ptr()`: under fake tensors
    (simulate/) no storage has memory, and every data pointer is 0."""
    return int(t.untyped_storage()._cdata)


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b start at the same byte of the same storage (as `data_ptr()`s equal,
    also for fake tensors)."""
    start = a.storage_offset() * a.element_size()
    return storage_id(a) == storage_id(b) and start == b.storage_offset() * b.element_size()


def _cpu_flash_flops(query: Any, key: Any, value: Any, *_: Any, **__: Any) -> int:
    from torch.utils.flop_counter import sdpa_flop_count  # only simulations count FLOPs

    return int(sdpa_flop_count(query, key, value))


def _cpu_flash_backward_flops(
    grad: Any, query: Any, key: Any, value: Any, *_: Any, **__: Any
) -> int:
    from torch.utils.flop_counter import sdpa_backward_flop_count

    return int(sdpa_backward_flop_count(grad, query, key, value))


def attention_flop_formulas() -> dict[Any, Any]:
    """FlopCounterMode's `custom_mapping` for the CPU's fused attention kernel, which its
    registry leaves out (2.11-2.14: it counts the CUDA kernels only), so that attention is
    counted on every device, as the CUDA kernels are (full, not halved when causal)."""
    aten = torch.ops.aten
    return {
        aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_flops,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward_flops,
    }


class _WholeProgram:
    """In place of FlopCounterMode's ModuleTracker: every FLOP counted under "Global"
    alone, the key its `get_total_flops` reads (2.11-2.14)."""

    parents = frozenset({"Global"})

    def __enter__(self) -> _WholeProgram:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def total_flop_counter() -> Any:
    """A FlopCounterMode (attention_flop_formulas' mapping) counting the total only. Its
    ModuleTracker hooks module gradients with multi-grad hooks, which fail under
    `autograd.grad` (ZB-H1's split backward runs there), so `mod_tracker` is replaced
    (2.11-2.14: a public attribute the counter reads `parents` from)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False, custom_mapping=attention_flop_formulas())
    if not hasattr(counter, "mod_tracker"):  # a torch that renamed it: the hooks would stay
        raise AttributeError("FlopCounterMode has no mod_tracker to replace")
    counter.mod_tracker = _WholeProgram()  # type: ignore[assignment]  # duck-typed: parents, with
    return counter


def _total_flops_counted() -> None:
    """total_flop_counter still counts: one (2, 3) x (3, 4) product is 48 FLOPs."""
    with total_flop_counter() as counter:
        torch.ones(2, 3, device="cpu") @ torch.ones(3, 4, device="cpu")
    if counter.get_total_flops() != 48:
        raise RuntimeError(f"counted {counter.get_total_flops()} FLOPs, not 48")


def register_fake_backend() -> None:
    """Make torch's "fake" process-group backend known (simulate/): importing its testing
    module registers it (2.11-2.14); a second call imports nothing."""
    importlib.import_module("torch.testing._internal.distributed.fake_pg")


# The ops behind host-side reads of tensors' values (.item(), float(t), bool(t); and
# torch.equal's bool), private in every supported release: simulate/ answers them.
HOST_READ_OP = torch.ops.aten._local_scalar_dense.default
EQUAL_OP = torch.ops.aten.equal.default
