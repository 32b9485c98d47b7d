"""A mixture of experts as the planner counts it: parameters (total and active), expert
memory per rank under ep, all-to-all bytes per layer with the router's load imbalance,
and FLOPs from the active parameters (docs/experts.md, "In the planner").

Every block's MLP becomes E SwiGLU experts of width f (each 3 h f), a router h x E and an
optional shared expert of width f_s (3 h f_s) that sees every token (DeepSeekMoE,
arXiv:2401.06066). Per token the k chosen experts run, so the active parameters are the
total less (E - k) experts per layer; training FLOPs are counted as for a dense model whose
MLP is k f + f_s wide, plus the router's 6 h E per token per layer.

Expert parallelism splits each layer's E experts over ep ranks (ep divides dp * cp, the
ranks that hold different tokens); tensor parallelism splits each expert's width as it
splits a dense MLP (Megatron-Core's expert tensor parallelism equal to tp). Expert
parameters are data-parallel over the expert_dp group of dp * cp / ep ranks, so ZeRO
shards them over that group; the rest over dp * cp.

Load imbalance: `Workload.moe_imbalance` is the busiest ep rank's routed assignments over
the mean, iota >= 1. A capacity factor c caps every expert at c times an even share, so the
planner charges min(iota, c). That rank computes iota times the mean expert FLOPs and holds
iota times the mean expert activations; its all-to-all bytes per pass are

    sends (dispatch) + receives sent back (combine) = (1 + iota) k N h e (ep - 1) / ep

for N tokens per rank and e bytes per element: with iota = 1 exactly
`plan/expert_cost.expected_token_bytes`, 2 k N h e (ep - 1) / ep (a rank's
outgoing assignments stay k N (ep - 1) / ep wherever they go; what it receives, and sends
back in the combine, grows with its load). Backward moves the same token bytes again; full
recomputation a third time. The counts all-to-all, (ep - 1) E/ep int64, is forward only.
"""

from __future__ import annotations

import math
from dataclasses import Field, replace
from typing import Any, ClassVar, Protocol, TypeVar

from paratrain.models.presets import ModelShape, kv_heads
from paratrain.plan.expert_cost import expected_token_bytes


class ModelView(Protocol):
    """plan.model.ModelSpec as these counts read it: model.py imports this module (its
    params), so this module cannot import that class."""

    __dataclass_fields__: ClassVar[dict[str, Field[Any]]]  # dense_equivalent replaces fields

    @property
    def name(self) -> str: ...
    @property
    def arch(self) -> str: ...
    @property
    def has_shape(self) -> bool: ...
    @property
    def shape(self) -> ModelShape: ...
    @property
    def ffn_hidden(self) -> int: ...
    @property
    def tie_embeddings(self) -> bool: ...
    @property
    def num_experts(self) -> int: ...
    @property
    def top_k(self) -> int: ...
    @property
    def expert_ffn(self) -> int: ...
    @property
    def shared_ffn(self) -> int: ...
    @property
    def capacity_factor(self) -> float | None: ...


Spec = TypeVar("Spec", bound=ModelView)


def check_moe(m: ModelView) -> None:
    """The MoE fields of a ModelSpec, in one place; ValueError naming the value."""
    if m.arch != "llama" or not m.has_shape:
        raise ValueError(
            f"model {m.name}: {m.num_experts} experts are counted for the llama architecture "
            "with its whole shape"
        )
    if not 1 <= m.top_k <= m.num_experts:
        raise ValueError(f"model {m.name}: top-k {m.top_k}; valid: 1 to {m.num_experts} experts")
    if m.capacity_factor is not None and m.capacity_factor <= 0:
        raise ValueError(f"model {m.name}: capacity factor {m.capacity_factor}; must be > 0")
    if m.expert_ffn < 0 or m.shared_ffn < 0:
        raise ValueError(f"model {m.name}: expert widths must be >= 0")


def expert_width(m: ModelView) -> int:
    return m.expert_ffn or m.ffn_hidden


def expert_params(m: ModelView) -> int:
    """One expert's SwiGLU matrices: gate, up and down, 3 h f."""
    return 3 * m.shape.d_model * expert_width(m)


def layer_expert_params(m: ModelView) -> int:
    """All E experts of one layer: what ep splits."""
    return m.num_experts * expert_params(m)


def _block_params(m: ModelView, experts: int) -> int:
    """A block with `experts` of its E experts: norms, attention, router, shared expert."""
    h, a = m.shape.d_model, m.shape.n_head
    d_kv = kv_heads(m.shape) * (h // a)
    attention = 2 * h * h + 2 * h * d_kv
    return 2 * h + attention + h * m.num_experts + 3 * h * m.shared_ffn + experts * expert_params(m)


def _ends(m: ModelView) -> int:
    h, v = m.shape.d_model, m.shape.vocab_size
    return v * h + h + (0 if m.tie_embeddings else v * h)


def total_params(m: ModelView) -> int:
    return m.shape.n_layer * _block_params(m, m.num_experts) + _ends(m)


def active_params(m: ModelView) -> int:
    """Parameters one token passes through: k experts per layer, not E."""
    return m.shape.n_layer * _block_params(m, m.top_k) + _ends(m)


def all_expert_params(m: ModelView) -> int:
    """Every layer's experts: the part of the parameters sharded by ep."""
    return m.shape.n_layer * layer_expert_params(m) if m.num_experts else 0


def charged_imbalance(m: ModelView, imbalance: float) -> float:
    """The busiest ep rank's load over the mean: the router's, capped by the capacity."""
    cap = m.capacity_factor if m.capacity_factor is not None else math.inf
    return min(imbalance, cap)


def expert_bytes_per_rank(m: ModelView, tp: int, pp: int, ep: int, param_bytes: int) -> float:
    """Expert weights one GPU holds before ZeRO: its stage's layers, E/ep experts each,
    1/tp of each expert's width."""
    layers = math.ceil(m.shape.n_layer / pp)
    return layers * layer_expert_params(m) / (ep * tp) * param_bytes


def dense_equivalent(m: Spec, imbalance: float = 1.0) -> Spec:
    """The dense model with the same per-token MLP work: width k f + f_s (times the
    charged imbalance for the k f that the busiest rank's experts run)."""
    width = m.top_k * expert_width(m) * charged_imbalance(m, imbalance) + m.shared_ffn
    return replace(m, ffn_hidden=math.ceil(width), num_experts=0, n_params=None)


def router_flops_per_token(m: ModelView) -> float:
    """The router's matrix, 2 h E forward and 4 h E backward per token per layer."""
    return 6 * m.shape.n_layer * m.shape.d_model * m.num_experts


def all_to_all_bytes(
    m: ModelView, tokens: float, ep: int, tp: int, elem: int, imbalance: float
) -> float:
    """Token bytes the busiest GPU sends per MoE layer per pass (module docstring), for
    `tokens` tokens on its ep rank; a tp group dispatches its tokens once, 1/tp each."""
    if ep == 1:
        return 0.0
    iota = charged_imbalance(m, imbalance)
    uniform = expected_token_bytes(tokens, m.top_k, ep, m.shape.d_model, elem)  # (1 + 1) k N h e ..
    return (1 + iota) / 2 * uniform / tp
