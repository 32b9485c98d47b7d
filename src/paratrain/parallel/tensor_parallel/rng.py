"""Dropout random streams for tensor parallelism: one replicated, one split.

In a replicated region (the residual stream, the embeddings) every tp rank holds the same
activation and must drop the same elements, or the copies drift apart and the replicated
parameters (LayerNorm) get different gradients on different ranks. In a split region
(attention heads, or any activation under sequence parallelism) each rank holds a
different part of the activation and must draw an independent mask for it, or the parts
would share one mask pattern. Megatron-LM keeps a named RNG state per region and swaps it
in around the region's forward (arXiv:1909.08053, section 3; `CudaRNGStatesTracker`).

`RngTracker` does the same with the default generator (CPU, and the current CUDA device
once CUDA is initialised), so `F.dropout` and `scaled_dot_product_attention` need no
generator argument. Masks are drawn in forward and saved for backward, so backward needs
no fork. The replicated stream is seeded with `seed` on every tp rank; the split stream
with `seed + 2718 + tp_rank`, Megatron's offset.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from paratrain.comm.compat import graph_break

REPLICATED = "replicated"
SPLIT = "split"
SPLIT_OFFSET = 2718


class RngTracker:
    """Named random states; `fork(name)` runs a region with its state, then restores."""

    def __init__(self, seed: int, tp_rank: int) -> None:
        self.seeds = {REPLICATED: seed, SPLIT: seed + SPLIT_OFFSET + tp_rank}
        self._cpu = {name: _cpu_state(s) for name, s in self.seeds.items()}
        self._cuda: dict[str, torch.Tensor] = {}  # seeded on first use on a GPU
        self._stack: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    def enter(self, name: str) -> None:
        use_cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        saved_cuda = torch.cuda.get_rng_state() if use_cuda else None
        self._stack.append((torch.get_rng_state(), saved_cuda))
        torch.set_rng_state(self._cpu[name])
        if use_cuda:
            if name not in self._cuda:
                torch.cuda.manual_seed(self.seeds[name])
                self._cuda[name] = torch.cuda.get_rng_state()
            torch.cuda.set_rng_state(self._cuda[name])

    def exit(self, name: str) -> None:
        self._cpu[name] = torch.get_rng_state()
        saved_cpu, saved_cuda = self._stack.pop()
        if saved_cuda is not None:
            self._cuda[name] = torch.cuda.get_rng_state()
            torch.cuda.set_rng_state(saved_cuda)
        torch.set_rng_state(saved_cpu)

    @contextmanager
    def fork(self, name: str) -> Iterator[None]:
        self.enter(name)
        try:
            yield
        finally:
            self.exit(name)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The CPU streams' states, for a checkpoint (CUDA streams are reseeded)."""
        return dict(self._cpu)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._cpu.update(state)

    def __repr__(self) -> str:
        return f"RngTracker({self.seeds})"


def _cpu_state(seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cpu")  # the CPU stream; CUDA streams are seeded apart
    gen.manual_seed(seed)
    return gen.get_state()


def fork_during_forward(module: nn.Module, tracker: RngTracker, name: str) -> None:
    """Run every forward of `module` inside `tracker.fork(name)` (hooks keep its names).

    The hooks swap the global generator's state: a compiled block (--compile) runs them
    eagerly, between its graphs, so its dropout draws from the stream they set."""

    @graph_break
    def enter(mod: nn.Module, args: Any) -> None:
        tracker.enter(name)

    @graph_break
    def leave(mod: nn.Module, args: Any, output: Any) -> None:
        tracker.exit(name)

    module.register_forward_pre_hook(enter)
    # always_call: the default stream is restored even when the forward raises.
    module.register_forward_hook(leave, always_call=True)
