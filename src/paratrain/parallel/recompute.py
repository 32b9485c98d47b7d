"""Activation recomputation per block (Chen et al. 2016, arXiv:1604.06174).

A recomputed block keeps only its input for backward; everything it computed inside is
dropped after forward and computed again when backward reaches it. Memory per block falls
to one (B, T, C) tensor, at the cost of one more forward of the block per step (Megatron's
"full" recomputation, Korthikanti et al. 2022, arXiv:2205.05198, section 5).

Applied from outside, like every strategy: the block's own forward is wrapped on the
instance, so parameter names and the state dict do not change.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from paratrain.config import RECOMPUTE_MODES


def _recomputed(forward: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        # Non-reentrant checkpointing: works with inputs that need no grad and restores the
        # RNG state, so dropout masks in the recomputation equal the first pass's.
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    run.recomputed = True  # type: ignore[attr-defined]
    return run


def apply_recomputation(blocks: nn.ModuleDict | list[nn.Module], mode: str = "full") -> int:
    """Recompute each block's activations in backward; return how many blocks changed."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute mode {mode!r}; valid: {', '.join(RECOMPUTE_MODES)}")
    if mode == "none":
        return 0
    modules = list(blocks.values()) if isinstance(blocks, nn.ModuleDict) else list(blocks)
    for block in modules:
        if not getattr(block.forward, "recomputed", False):
            block.forward = _recomputed(block.forward)
    return len(modules)
