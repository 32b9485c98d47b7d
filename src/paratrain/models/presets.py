"""Named models, shared by `paratrain train --model NAME` and `paratrain plan --preset NAME`.

Pure data and arithmetic (no torch): each preset is the [model] fields it sets, and
`param_count` counts a model's parameters exactly from those fields, as the built module
has them (tests/test_models.py builds every preset on the meta device and compares).

Published shapes: GPT-2 small (Radford et al. 2019; Hugging Face `gpt2`: 124,439,808
parameters, head tied to the token embedding); Llama 3.2 1B and Llama 3 8B, 70B and 405B
(Meta's model cards and Hugging Face configs: 1,235,814,400, 8,030,261,248,
70,553,706,496 and 405,853,388,800; 405B's context is Llama 3.1's).
"""

from __future__ import annotations

import math
from typing import Any, Protocol

MODEL_PRESETS: dict[str, dict[str, Any]] = {
    # Today's default: a 4-layer byte-level GPT of 0.9M parameters, trained in seconds.
    "gpt-tiny": {"arch": "gpt", "vocab_size": 256, "n_layer": 4, "n_head": 4, "d_model": 128,
                 "max_seq_len": 256},
    "gpt2-124m": {"arch": "gpt", "vocab_size": 50257, "n_layer": 12, "n_head": 12,
                  "d_model": 768, "max_seq_len": 1024, "tie_embeddings": True,
                  "activation": "gelu_tanh"},
    # CPU-sized: grouped-query attention (2 query heads per key/value head), SwiGLU.
    "llama-tiny": {"arch": "llama", "vocab_size": 256, "n_layer": 4, "n_head": 4,
                   "n_kv_head": 2, "d_model": 128, "ffn_hidden": 352, "max_seq_len": 256},
    # CPU-sized mixture of experts: 4 experts of the dense MLP's width, 2 per token
    # (GShard), capacity 1.25 (tokens beyond it dropped, counted in the log).
    "moe-tiny": {"arch": "gpt", "vocab_size": 256, "n_layer": 2, "n_head": 4, "d_model": 64,
                 "max_seq_len": 128, "num_experts": 4, "top_k": 2, "capacity_factor": 1.25},
    "llama3-1b": {"arch": "llama", "vocab_size": 128256, "n_layer": 16, "n_head": 32,
                  "n_kv_head": 8, "d_model": 2048, "ffn_hidden": 8192, "max_seq_len": 8192,
                  "rope_theta": 500000.0, "tie_embeddings": True},
    "llama3-8b": {"arch": "llama", "vocab_size": 128256, "n_layer": 32, "n_head": 32,
                  "n_kv_head": 8, "d_model": 4096, "ffn_hidden": 14336, "max_seq_len": 8192,
                  "rope_theta": 500000.0},
    "llama3-70b": {"arch": "llama", "vocab_size": 128256, "n_layer": 80, "n_head": 64,
                   "n_kv_head": 8, "d_model": 8192, "ffn_hidden": 28672, "max_seq_len": 8192,
                   "rope_theta": 500000.0},
    # Llama 3 405B (Llama 3.1's context: pre-trained at 8192, then extended to 131,072)
    "llama3-405b": {"arch": "llama", "vocab_size": 128256, "n_layer": 126, "n_head": 128,
                    "n_kv_head": 8, "d_model": 16384, "ffn_hidden": 53248,
                    "max_seq_len": 131072, "rope_theta": 500000.0},
}  # fmt: skip

CUSTOM = "custom"  # no preset: every [model] field as given (an imported model's)

PUBLISHED_PARAMS = {  # the counts of the published checkpoints, for the tests
    "gpt2-124m": 124_439_808,
    "llama3-1b": 1_235_814_400,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3-405b": 405_853_388_800,
}


class ModelShape(Protocol):  # config.ModelConfig, as far as the counts read it (read-only)
    @property
    def arch(self) -> str: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def n_layer(self) -> int: ...
    @property
    def n_head(self) -> int: ...
    @property
    def n_kv_head(self) -> int: ...
    @property
    def d_model(self) -> int: ...
    @property
    def ffn_hidden(self) -> int: ...
    @property
    def max_seq_len(self) -> int: ...
    @property
    def tie_embeddings(self) -> bool: ...

    # num_experts, shared_expert: read with getattr (0, False) so that shapes without them
    # (the planner's ModelSpec) count as dense.


def preset(name: str) -> dict[str, Any]:
    """The preset's [model] fields; none for CUSTOM."""
    if name == CUSTOM:
        return {}
    if name not in MODEL_PRESETS:
        raise ValueError(f"--model {name!r}; valid: {', '.join([*MODEL_PRESETS, CUSTOM])}")
    return MODEL_PRESETS[name]


def kv_heads(m: ModelShape) -> int:
    """Key/value heads: n_kv_head, or n_head when 0 (multi-head attention)."""
    return m.n_kv_head or m.n_head


def ffn_width(m: ModelShape) -> int:
    """The MLP's inner width: GPT's 4 d; Llama's ffn_hidden, or 8/3 d rounded up to 32."""
    if m.arch == "gpt":
        return 4 * m.d_model
    return m.ffn_hidden or 32 * math.ceil(8 * m.d_model / 3 / 32)


def param_count(m: ModelShape) -> int:
    """Exact parameter count of the model the fields describe (a tied head counts once).

    gpt (models/gpt.py): per block LayerNorms 4d, q/k/v/proj 4(d^2 + d), MLP 8 d^2 + 5d;
    ends: token and position tables (V + T_max) d, final LayerNorm 2d, head V d.
    llama (models/llama.py): per block RMSNorms 2d, q and o 2 d^2, k and v 2 d d_kv, SwiGLU
    3 d f, no biases; ends: token table V d, final RMSNorm d, head V d.
    """
    d, v = m.d_model, m.vocab_size
    head = 0 if m.tie_embeddings else v * d
    if m.arch == "gpt":
        block = 4 * d * d + 8 * d + feed_forward_params(m)
        return m.n_layer * block + v * d + m.max_seq_len * d + 2 * d + head
    d_kv = kv_heads(m) * (d // m.n_head)
    block = 2 * d * d + 2 * d * d_kv + feed_forward_params(m) + 2 * d
    return m.n_layer * block + v * d + d + head


def feed_forward_params(m: ModelShape) -> int:
    """One block's MLP: gpt fc and proj 8 d^2 + 5d, llama SwiGLU 3 d f; as a mixture of E
    experts (models/moe.py, no biases): router E d, experts E times 2 d f (gpt) or 3 d f
    (llama), a shared expert once more."""
    d, f = m.d_model, ffn_width(m)
    per_expert = (2 if m.arch == "gpt" else 3) * d * f
    experts = getattr(m, "num_experts", 0)
    if not experts:
        return per_expert + (5 * d if m.arch == "gpt" else 0)
    shared = per_expert if getattr(m, "shared_expert", False) else 0
    return experts * d + experts * per_expert + shared
