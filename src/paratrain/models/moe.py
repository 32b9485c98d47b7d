"""A mixture-of-experts feed-forward layer in plain PyTorch (docs/experts.md).

    x (B, T, C) -> router: k experts and weights per token -> capacity: drop the overflow
      -> tokens grouped by expert -> experts -> weighted sum per token (+ shared expert)

returning (output, auxiliary loss). A dropped assignment contributes 0, so a token with
every choice dropped comes out as 0 and, in a residual block x + moe(x), passes through
unchanged (Switch, arXiv:2101.03961, section 2.2).

Two seams let expert parallelism be applied from outside without the layer knowing a
process group (parallel/expert_parallel/):
- `experts` is any module called as experts(tokens grouped by expert, counts per expert)
  whose parameters are stacked along dimension 0, one row per expert; parallelism swaps
  in one that sends the tokens to the ranks holding their experts.
- `batch` says which shard of the batch these tokens are and gathers every shard's counts;
  capacity and the balancing statistics are computed from those, over the whole batch,
  so the output does not depend on the layout. The default, `WholeBatch`, is one shard:
  the single-process layer, the oracle every layout is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.models.router import (
    Router,
    balance_bias,
    capacity,
    load_balancing_loss,
    queue_positions,
    slot_counts,
)

ACTIVATIONS = ("gelu", "swiglu")


@dataclass(frozen=True)
class MoEConfig:
    d_model: int = 128
    num_experts: int = 8
    hidden: int = 256  # inner width of each expert
    top_k: int = 2  # experts per token (1: Switch, 2: GShard)
    capacity_factor: float | None = None  # C = ceil(factor·k·T/E) per expert; None: no drops
    aux_loss_coef: float = 0.01  # α of Switch's load-balancing loss; 0: none
    bias_rate: float = 0.0  # γ of DeepSeek-V3's bias balancing; 0: no bias
    score: str = "softmax"  # router affinities: "softmax" or "sigmoid" (DeepSeek-V3)
    normalize: bool = False  # rescale the k chosen weights to sum to 1
    shared_hidden: int = 0  # inner width of a shared expert that sees every token; 0: none
    activation: str = "gelu"  # "gelu" or "swiglu"

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r}; valid: {', '.join(ACTIVATIONS)}")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"capacity factor {self.capacity_factor} must be positive")


class BatchView(Protocol):
    """Where this layer's tokens sit in the batch: shard `index` of `shards`."""

    shards: int
    index: int

    def gather(self, counts: torch.Tensor) -> torch.Tensor:
        """(shards, *counts.shape): every shard's counts, in batch order."""
        ...


class WholeBatch:
    """The tokens are the whole batch."""

    shards, index = 1, 0

    def gather(self, counts: torch.Tensor) -> torch.Tensor:
        return counts.unsqueeze(0)


@dataclass
class RoutingStats:
    """One forward's routing over the whole batch (every shard sees the same)."""

    tokens: int
    capacity: int | None
    load: torch.Tensor  # (E,) assignments each expert was chosen for, before capacity
    kept: torch.Tensor  # (E,) assignments each expert computed
    dropped: int  # assignments over capacity


class Experts(nn.Module):
    """E feed-forward networks, parameters stacked along dimension 0."""

    def __init__(
        self,
        num_experts: int,
        d_model: int,
        hidden: int,
        activation: str,
        device: torch.device | str | None = None,  # as nn.Linear's: None, the default device
    ) -> None:
        super().__init__()
        self.activation = activation
        shape_in, shape_out = (num_experts, d_model, hidden), (num_experts, hidden, d_model)
        self.w_in = nn.Parameter(torch.empty(shape_in, device=device))
        self.w_out = nn.Parameter(torch.empty(shape_out, device=device))
        self.w_gate = None
        if activation == "swiglu":
            self.w_gate = nn.Parameter(torch.empty(shape_in, device=device))
        for p in self.parameters():
            nn.init.normal_(p, mean=0.0, std=0.02)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (M, C): counts[e] rows for expert e, in expert order -> (M, C)."""
        pieces = x.split(counts.tolist())
        return torch.cat([self._one(e, rows) for e, rows in enumerate(pieces)])

    def _one(self, e: int, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.w_in[e]  # (n, H)
        if self.w_gate is None:
            h = F.gelu(h)
        else:
            h = F.silu(x @ self.w_gate[e]) * h
        return h @ self.w_out[e]  # (n, C)

    def extra_repr(self) -> str:
        e, c, h = self.w_in.shape
        return f"experts={e}, d_model={c}, hidden={h}, activation={self.activation}"


class MoE(nn.Module):
    load: torch.Tensor  # a buffer (registered below): typed for the checker

    def __init__(self, cfg: MoEConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.router = Router(
            cfg.d_model, cfg.num_experts, cfg.top_k, cfg.score, cfg.normalize, device
        )
        self.experts: nn.Module = Experts(
            cfg.num_experts, cfg.d_model, cfg.hidden, cfg.activation, device
        )
        self.shared: Experts | None = None
        if cfg.shared_hidden:  # DeepSeekMoE's shared expert (arXiv:2401.06066)
            self.shared = Experts(1, cfg.d_model, cfg.shared_hidden, cfg.activation, device)
        self.batch: BatchView = WholeBatch()
        # Chosen assignments since the last `balance_bias` (the bias's step may span
        # micro-batches). Not saved: it is empty after every step.
        self.register_buffer("load", torch.zeros(cfg.num_experts, device=device), persistent=False)
        self.stats: RoutingStats | None = None
        # True while activation recomputation runs this layer again (parallel/recompute.py):
        # the same routing, not one more forward to count.
        self.recomputing = False

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (..., C) -> (output (..., C), this shard's part of the auxiliary loss)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (N, C)
        route = self.router(x)
        keep, load, tokens = self._assign(route.experts)
        k = self.cfg.top_k
        # Kept assignments, grouped by expert; assignment a is token a // k's choice a % k.
        chosen = route.experts.flatten()[keep]  # (M,)
        order = chosen.argsort(stable=True)
        token = keep.nonzero().squeeze(1)[order] // k  # (M,) the token of each row
        counts = torch.bincount(chosen, minlength=self.cfg.num_experts)  # (E,)
        y = self.experts(x[token], counts)  # (M, C)
        weight = route.weights.flatten()[keep][order]  # (M,)
        out = torch.zeros_like(x).index_add(0, token, y * weight.unsqueeze(1))
        if self.shared is not None:
            out = out + self.shared(x, torch.tensor([x.shape[0]], device=x.device))
        aux = x.new_zeros(())
        if self.cfg.aux_loss_coef:
            shards = self._view().shards
            aux = load_balancing_loss(route.scores, load, tokens, k, shards, self.cfg.aux_loss_coef)
        return out.view(shape), aux

    def _assign(self, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Which of this shard's N·k assignments fit (N·k,); load (E,); tokens in the batch.

        The only place that looks beyond this shard: every shard's counts per slot and
        expert, from which capacity and each assignment's global queue place follow.
        """
        cfg = self.cfg
        view = self._view()
        every = view.gather(slot_counts(experts, cfg.num_experts))  # (S, k, E)
        before, total = every[: view.index].sum(0), every.sum(0)  # (k, E) each
        tokens = int(total[0].sum())  # every token has exactly one first choice
        limit = capacity(tokens, cfg.num_experts, cfg.top_k, cfg.capacity_factor)
        load = total.sum(0)  # (E,)
        if limit is None:
            keep = torch.ones(experts.numel(), dtype=torch.bool, device=experts.device)
        else:
            keep = (queue_positions(experts, before, total) < limit).flatten()
        # One queue per expert, slot 0 first: the first `limit` of its load are kept.
        kept = load if limit is None else load.clamp(max=limit)
        self.stats = RoutingStats(tokens, limit, load, kept, int((load - kept).sum()))
        if self.training and cfg.bias_rate and not self.recomputing:
            self.load += load
        return keep, load, tokens

    def _view(self) -> BatchView:
        """Training routes over the whole batch; evaluation over each shard's own batch,
        since held-out batches are spread over the ranks one per rank, and one process
        evaluates them one at a time."""
        return self.batch if self.training else WholeBatch()

    def balance_bias(self) -> None:
        """After the optimizer step: move the router's bias toward balance, restart counting."""
        if self.cfg.bias_rate:
            balance_bias(self.router.bias, self.load, self.cfg.bias_rate)
        self.load.zero_()


@dataclass
class RoutingTally:
    """A layer's routing summed over the forwards since the last `take` (one step's)."""

    kept: torch.Tensor  # (E,) assignments each expert computed
    aux: torch.Tensor  # this shard's auxiliary losses, summed (detached)
    assignments: int = 0  # chosen, before capacity
    dropped: int = 0
    forwards: int = 0


class MoEFeedForward(MoE):
    """The MoE as a block's feed-forward, called like the dense MLP it replaces (x -> y).

    The auxiliary loss of the last forward waits in `aux` for the model to add it to its
    loss (`add_aux_loss`); a training forward's routing is added to `tally`, which the
    training step reads once per step (`take_tally`).
    """

    def __init__(self, cfg: MoEConfig, device: torch.device | str | None = None) -> None:
        super().__init__(cfg, device)
        self.aux: torch.Tensor | None = None
        self.tally: RoutingTally | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        out, self.aux = super().forward(x)
        if self.training and self.stats is not None and not self.recomputing:
            self._count(self.stats, self.aux.detach())
        return out

    def _count(self, stats: RoutingStats, aux: torch.Tensor) -> None:
        t = self.tally or RoutingTally(torch.zeros_like(stats.kept), aux=torch.zeros_like(aux))
        t.kept = t.kept + stats.kept
        t.assignments += stats.tokens * self.cfg.top_k
        t.dropped += stats.dropped
        t.aux = t.aux + aux
        t.forwards += 1
        self.tally = t

    def take_tally(self) -> RoutingTally | None:
        """The routing since the last call, and start counting afresh."""
        tally, self.tally = self.tally, None
        return tally


def moe_layers(model: nn.Module) -> list[MoEFeedForward]:
    return [m for m in model.modules() if isinstance(m, MoEFeedForward)]


def aux_loss(model: nn.Module) -> torch.Tensor | None:
    """In training, the sum of the auxiliary losses of the model's MoE blocks' last
    forwards (Switch: the balancing term is part of the objective); None for a dense model
    or in evaluation. A pipeline stage without the loss adds its blocks' this way."""
    if not model.training:
        return None
    terms = [layer.aux for layer in moe_layers(model) if layer.aux is not None]
    return torch.stack(terms).sum() if terms else None


def add_aux_loss(model: nn.Module, loss: torch.Tensor) -> torch.Tensor:
    """The model's loss plus `aux_loss(model)`; a dense model's loss comes back untouched."""
    aux = aux_loss(model)
    return loss if aux is None else loss + aux
