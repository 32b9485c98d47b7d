"""[model]: the network's shape, as presets (models/presets.py) and flags give it."""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.config.choices import ARCHS, GELUS
from paratrain.config.conditions import GPT, LLAMA, MOE
from paratrain.config.fields import param


@dataclass
class ModelConfig:
    name: str = param(
        "gpt-tiny",
        "Model preset (models/presets.py); its shape is the default of every [model] field.",
        flag="--model",
    )
    arch: str = param("gpt", "Architecture.", choices=ARCHS)
    vocab_size: int = param(256, "Vocabulary size; 256 for byte-level text.", at_least=1)
    # at most: deeper than any model trained, and the planner lists every block's tensors
    n_layer: int = param(4, "Number of transformer blocks.", at_least=1, at_most=100_000)
    n_head: int = param(4, "Attention heads per block; must divide d_model.", at_least=1)
    n_kv_head: int = param(
        0,
        "llama: key/value heads (grouped-query attention); 0: n_head.",
        at_least=0,
        effect=LLAMA,
    )
    d_model: int = param(128, "Width of the residual stream.", at_least=1)
    ffn_hidden: int = param(
        0,
        "llama: SwiGLU's inner width; 0: 8/3 d_model, rounded up to 32.",
        at_least=0,
        effect=LLAMA,
    )
    max_seq_len: int = param(
        256, "Longest training sequence (gpt: the position table's rows).", at_least=1
    )
    tie_embeddings: bool = param(False, "The output head shares the token embedding's matrix.")
    rope_theta: float = param(
        10000.0, "llama: base of the rotary position frequencies.", above=0, effect=LLAMA
    )
    norm_eps: float = param(1e-5, "llama: RMSNorm's epsilon.", above=0, effect=LLAMA)
    dropout: float = param(
        0.0, "gpt: dropout in embeddings, attention and residuals.", at_least=0, below=1,
        effect=GPT,
    )  # fmt: skip
    activation: str = param(
        "gelu",
        "gpt: the MLP's GELU (gelu_tanh: GPT-2's tanh approximation).",
        choices=GELUS,
        effect=GPT,
    )
    # Mixture of experts (models/moe.py, docs/experts.md): every block's MLP becomes one.
    num_experts: int = param(
        0, "Experts per MoE feed-forward (each as wide as the MLP); 0: dense.", at_least=0
    )
    top_k: int = param(
        2, "MoE: experts each token is sent to (1: Switch, 2: GShard).", at_least=1, effect=MOE
    )
    capacity_factor: float = param(
        0.0,
        "MoE: each expert takes at most ceil(factor * k * T / E) of a batch's T tokens; 0: all.",
        at_least=0,
        effect=MOE,
    )
    aux_loss_coef: float = param(
        0.01, "MoE: weight of Switch's load-balancing loss; 0: none.", at_least=0, effect=MOE
    )
    bias_rate: float = param(
        0.0,
        "MoE: DeepSeek-V3's balancing bias step per optimizer step; 0: off.",
        at_least=0,
        effect=MOE,
    )
    shared_expert: bool = param(
        False, "MoE: add a shared expert (as wide as the MLP) for every token.", effect=MOE
    )
