"""Activation recomputation per block (Chen et al. 2016, arXiv:1604.06174), two modes.

full: a recomputed block keeps only its input for backward; everything it computed inside
is dropped after forward and computed again when backward reaches it. Memory per block
falls to one (B, T, C) tensor, at the cost of one more forward of the block per step
(Megatron's "full" recomputation, Korthikanti et al. 2022, arXiv:2205.05198, section 5).

selective: an op-level policy through PyTorch's selective activation checkpointing
(`checkpoint(..., context_fn=...)` with `create_selective_checkpoint_contexts(policy)`).
The block keeps the outputs of its matrix multiplies (aten mm and addmm: every Linear)
and of fused attention (SDPA's kernel: its output and logsumexp), and recomputes the rest
in backward: norms, activations, rotary, residual adds, copies, and the tensor-parallel
collectives between them. So no matrix multiply runs twice; what runs twice is pointwise
(plan/time.py counts it). This is not Korthikanti et al.'s "selective" (recompute the
attention core to drop its s^2 scores and dropout masks): a fused kernel keeps no scores,
so that variant saves nothing here, while norms and activations hold a large share of
a block's activations (plan/activations.py counts what stays). Three rules keep it exact:
- bmm is not kept. It is no Linear here, but SDPA's math fallback (attention dropout on
  the CPU, or masks) computing q k^T and scores x v: keeping those would keep the s^2
  scores. They are recomputed, which is Korthikanti's attention-core recomputation.
- A fused attention that draws dropout is recomputed: skipping a random op in the
  recomputation would shift the random stream that the later dropout masks come from.
- Collectives are recomputed: they run in place on buffers, which a cache cannot
  replay. With tensor parallelism selective repeats the collectives that full repeats.
The op-level policy cannot see that backward never reads the block's last matmul output
(it only feeds the residual add): that one is kept as well (plan/activations.py counts it).

Applied from outside, like every strategy: the block's own forward is wrapped on the
instance, so parameter names and the state dict do not change.

A module that keeps a record of its forwards (a mixture of experts' routing tally and the
load its balancing bias follows) must not count the recomputation as one more: every
submodule of the block with a `recomputing` attribute has it True while the block is
recomputed (`Recomputing`, entered by the checkpoint's recompute context).
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Callable
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from paratrain.comm import compat
from paratrain.config import RECOMPUTE_MODES

aten = torch.ops.aten
MATMULS = frozenset({aten.mm.default, aten.addmm.default})  # a Linear, at any batch shape
FUSED_ATTENTION = frozenset(
    {
        aten._scaled_dot_product_flash_attention.default,  # CUDA
        aten._scaled_dot_product_efficient_attention.default,  # CUDA
        aten._scaled_dot_product_cudnn_attention.default,  # CUDA
        aten._scaled_dot_product_flash_attention_for_cpu.default,
    }
)


def _dropout_p(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
    for i, arg in enumerate(op._schema.arguments):
        if arg.name == "dropout_p":
            p: float = kwargs.get("dropout_p", args[i] if i < len(args) else arg.default_value)
            return p
    return 0.0


def keeps(op: Any, *args: Any, **kwargs: Any) -> bool:
    """The selective policy, per aten op: True for the ops whose outputs are kept."""
    if op in MATMULS:
        return True
    return op in FUSED_ATTENTION and _dropout_p(op, args, kwargs) == 0


class _Show(torch.autograd.Function):
    """Identity on a block's output that saves the tensors the policy kept, so that
    saved-tensor hooks count them (measure/activations.py's meter: the pipeline's
    in-flight bytes, `plan --validate`): the checkpoint's cache holds them outside
    autograd's hooks. The same storages: no memory is added."""

    apply: ClassVar[Callable[..., torch.Tensor]]  # (y, *kept); torch: untyped

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, *kept: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*kept)
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (grad, *[None] * len(ctx.saved_tensors))


class _Replayable:
    """The recomputation's context, re-armed for every backward through the region.

    torch's cache hands each kept tensor out once ("only allowed to backward once"), but
    ZB-H1 goes through a block twice: dL/dx with the graph retained, then dL/dW
    (parallel/pipeline/runtime.py), as full recomputation allows. The first recomputation
    notes the cache's entries and every later one puts them back. The tensors stay held
    until the graph is freed, where torch would release them during the recomputation.
    """

    def __init__(self, cached: Any) -> None:
        self.cached = cached  # torch's _CachedTorchDispatchMode; `storage` is its cache
        self.entries: dict[Any, Any] | None = None

    def __enter__(self) -> Any:
        if self.entries is None:
            self.entries = compat.sac_snapshot(self.cached.storage)
        else:
            compat.sac_restore(self.cached.storage, self.entries)
        return self.cached.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        return self.cached.__exit__(*exc)


@runtime_checkable
class _Flagged(Protocol):
    recomputing: bool  # isinstance checks only that the attribute exists


class Recomputing:
    """Inside a block's recomputation: its modules that declare `recomputing` see True."""

    def __init__(self, block: nn.Module, inner: Any = None) -> None:
        self.flagged = [m for m in block.modules() if isinstance(m, _Flagged)]
        self.inner = inner or contextlib.nullcontext()

    def __enter__(self) -> Any:
        for m in self.flagged:
            m.recomputing = True
        return self.inner.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        for m in self.flagged:
            m.recomputing = False
        return self.inner.__exit__(*exc)


def _unbound_forward(block: nn.Module) -> Callable[..., Any]:
    """block's forward as a function of (block, *args): its class's, or an instance's own
    (a compiled forward: parallel/compile.py), which is called without the block."""
    forward = block.forward
    if inspect.ismethod(forward) and forward.__self__ is block:
        return forward.__func__
    return lambda _block, *args, **kwargs: forward(*args, **kwargs)


def _recomputed(block: nn.Module, mode: str) -> Callable[..., Any]:
    # The block holds `run` (its forward); `run` holds the block only weakly. A strong
    # reference would be a cycle that only the cyclic collector frees: a pipeline split
    # dropped the other stages' blocks, and with recomputation their parameters stayed
    # alive (found by simulate's memory meter: llama3-70b over pp 8 kept the whole
    # tp-split model in fp32 on every rank, 35 GB).
    owner, forward = weakref.ref(block), _unbound_forward(block)

    def run(*args: Any, **kwargs: Any) -> Any:
        me = owner()
        assert me is not None  # its caller holds it
        # Non-reentrant checkpointing: works with inputs that need no grad and restores the
        # RNG state, so dropout masks in the recomputation equal the first pass's.
        if mode == "full":
            marked = lambda: (contextlib.nullcontext(), Recomputing(me))  # noqa: E731
            return checkpoint(forward, me, *args, use_reentrant=False, context_fn=marked, **kwargs)
        caches: list[Any] = []  # the checkpoint's cache, read once its forward has run

        def policy(ctx: Any, op: Any, *a: Any, **kw: Any) -> CheckpointPolicy:
            return (
                CheckpointPolicy.MUST_SAVE
                if keeps(op, *a, **kw)
                else CheckpointPolicy.PREFER_RECOMPUTE
            )

        def contexts() -> tuple[Any, Any]:
            caching, cached = create_selective_checkpoint_contexts(policy)
            caches.append(cached.storage)
            return caching, Recomputing(me, _Replayable(cached))

        y = checkpoint(forward, me, *args, use_reentrant=False, context_fn=contexts, **kwargs)
        kept = compat.sac_kept_tensors(caches[0]) if caches else []
        return _Show.apply(y, *kept) if kept else y

    run.recomputed = mode  # type: ignore[attr-defined]  # a mark on the function, read back
    return run


def apply_recomputation(blocks: nn.ModuleDict | list[nn.Module], mode: str = "full") -> int:
    """Recompute each block's activations in backward, all of them ("full") or all but
    the matmul and fused-attention outputs ("selective"); return how many blocks changed."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute mode {mode!r}; valid: {', '.join(RECOMPUTE_MODES)}")
    if mode == "none":
        return 0
    modules = list(blocks.values()) if isinstance(blocks, nn.ModuleDict) else list(blocks)
    for block in modules:
        if not getattr(block.forward, "recomputed", False):
            block.forward = _recomputed(block, mode)
    return len(modules)
