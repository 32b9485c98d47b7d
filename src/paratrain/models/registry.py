"""From the run's [model] fields to a plain model: one entry per architecture (data, not a
switch). Each model's parallel plan is models/plans.py's PLANS[arch]."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from paratrain.config import ModelConfig
from paratrain.models.gpt import GPT, GPTConfig
from paratrain.models.llama import Llama, LlamaConfig
from paratrain.models.moe import MoEConfig
from paratrain.models.presets import ffn_width, kv_heads

EXPERT_ACTIVATION = {"gpt": "gelu", "llama": "swiglu"}  # each expert is the arch's MLP


def moe_config(m: ModelConfig) -> MoEConfig | None:
    """The blocks' mixture of experts, each expert as wide as the dense MLP; None: dense."""
    if not m.num_experts:
        return None
    width = ffn_width(m)
    return MoEConfig(
        d_model=m.d_model,
        num_experts=m.num_experts,
        hidden=width,
        top_k=m.top_k,
        capacity_factor=m.capacity_factor or None,
        aux_loss_coef=m.aux_loss_coef,
        bias_rate=m.bias_rate,
        shared_hidden=width if m.shared_expert else 0,
        activation=EXPERT_ACTIVATION[m.arch],
    )


def gpt_config(m: ModelConfig) -> GPTConfig:
    return GPTConfig(
        m.vocab_size,
        m.n_layer,
        m.n_head,
        m.d_model,
        m.max_seq_len,
        m.dropout,
        m.tie_embeddings,
        m.activation,
        moe_config(m),
    )


def llama_config(m: ModelConfig) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=m.vocab_size,
        n_layer=m.n_layer,
        n_head=m.n_head,
        n_kv_head=kv_heads(m),
        d_model=m.d_model,
        ffn_hidden=ffn_width(m),
        max_seq_len=m.max_seq_len,
        rope_theta=m.rope_theta,
        norm_eps=m.norm_eps,
        tie_embeddings=m.tie_embeddings,
        moe=moe_config(m),
    )


ARCHITECTURES: dict[str, tuple[Callable[[Any], nn.Module], Callable[[ModelConfig], Any]]] = {
    "gpt": (GPT, gpt_config),
    "llama": (Llama, llama_config),
}


def plain_model(m: ModelConfig) -> nn.Module:
    """The model the fields describe, on the current default device, from the current seed."""
    module, config_of = ARCHITECTURES[m.arch]
    return module(config_of(m))
