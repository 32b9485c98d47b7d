"""Context parallelism applied from outside a plain model, as tensor parallelism is.

    model = GPT(cfg)                                       # full model, same seed everywhere
    apply_context_parallel(model, GPT_PLAN.context_attention, GPT_PLAN.context_positions,
                           mesh.group("cp"), method="ring")
    inputs, targets = TokenShard.of(mesh.group("cp"), "ring")(batch)   # this rank's tokens

The model's two sequence-dependent pieces (models/position_dependent.py) are swapped: every core
attention for ring or all-to-all attention over the cp group, every positions module for
the global positions of this rank's chunks (learned absolute positions, rotary angles).
Everything else works token by token and runs unchanged on the rank's n = s/cp tokens;
no parameter is touched, so names, shapes and the state dict stay the plain model's.

The layout: ring attention takes the load-balanced one (chunks r and 2cp-1-r of 2cp, so
every rank does the same causal work); all-to-all attention the plain one (chunk r of cp),
which it needs no balancing for (docs/context-parallel.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from paratrain.comm.group import CommGroup
from paratrain.module_names import matching
from paratrain.parallel.context_parallel import layout
from paratrain.parallel.context_parallel.ring import ring_attention
from paratrain.parallel.context_parallel.ulysses import ulysses_attention
from paratrain.token_rows import model_keywords, split_rows

# method -> (attention, load-balanced layout); config.CP_METHODS lists the same names
METHODS = {"ring": (ring_attention, True), "alltoall": (ulysses_attention, False)}


def balanced(method: str) -> bool:
    return METHODS[method][1]


class ContextParallelAttention(nn.Module):
    """Causal attention of this rank's tokens over the whole sequence, held across `group`."""

    def __init__(self, group: CommGroup, method: str) -> None:
        super().__init__()
        self.group, self.method = group, method
        self._attend, self.balanced = METHODS[method]

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        past: int = 0,
        dropout_p: float = 0.0,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # Each refused by the configuration checks before a run starts.
        if past or dropout_p or positions is not None:
            raise ValueError(
                f"context-parallel attention: no KV cache (past {past}), no attention "
                f"dropout (p {dropout_p}) and no packed documents; decode with the plain model"
            )
        return self._attend(q, k, v, self.group, causal=True, balanced=self.balanced)

    def extra_repr(self) -> str:
        return f"method={self.method}, cp_rank={self.group.rank}/{self.group.size}"


class ContextParallelPositions(nn.Module):
    """The global positions of this rank's n tokens: its chunks of an n·cp sequence."""

    def __init__(self, group: CommGroup, method: str) -> None:
        super().__init__()
        self.cp, self.rank, self.balanced = group.size, group.rank, balanced(method)

    def forward(self, length: int, past: int, device: torch.device) -> torch.Tensor:
        assert past == 0, "context parallelism has no KV cache"
        return layout.positions(length * self.cp, self.cp, self.rank, self.balanced, device)

    def extra_repr(self) -> str:
        kind = "load-balanced" if self.balanced else "plain"
        return f"{kind} layout, cp_rank={self.rank}/{self.cp}"


def apply_context_parallel(
    model: nn.Module, attention: str, positions: str, group: CommGroup, method: str
) -> nn.Module:
    """Swap `model`'s core attentions and positions modules (module-name patterns, `*` one
    name component: models/plans.py) for their context-parallel versions; in place."""
    if method not in METHODS:
        raise ValueError(f"context parallel method {method!r}; valid: {', '.join(METHODS)}")
    pieces = ((attention, ContextParallelAttention), (positions, ContextParallelPositions))
    for pattern, make in pieces:
        names = matching(model, pattern)
        if not names:
            raise ValueError(f"context parallel plan: {pattern!r} matches no module of the model")
        for name in names:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, make(group, method))
    return model


@dataclass(frozen=True)
class TokenShard:
    """A micro-batch's rows of T + 1 ids -> (inputs, targets), each (b, n): this rank's
    tokens of the sequence. Inputs and targets are sharded alike, so every target stays
    beside its input, and the loss summed over the group's ranks is the whole sequence's."""

    cp: int = 1
    rank: int = 0
    balanced: bool = False
    packed: bool = False  # rows of packed documents (--packing documents): their positions

    @classmethod
    def of(cls, group: CommGroup, method: str) -> TokenShard:
        return cls(group.size, group.rank, balanced(method))

    def __call__(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = split_rows(batch)  # (b, T) each; the mask in the targets
        if self.cp == 1:
            return inputs, targets
        inputs, targets = (
            layout.shard(t, self.cp, self.rank, self.balanced, dim=1) for t in (inputs, targets)
        )
        return inputs, targets  # (b, n) each

    def keywords(self, batch: torch.Tensor) -> dict[str, torch.Tensor]:
        """The model call's other arguments (token_rows.model_keywords): packed documents'
        positions, which context-parallel attention does not take (refused before a run).
        Read from the rows only when the run packs documents, a fact of its layout, not
        of its data (a simulated run's rows are fake tensors)."""
        if not self.packed:
            return {}
        if self.cp > 1:
            raise ValueError("packed documents (--packing documents) under context parallelism")
        return model_keywords(batch)
