"""The peer of `bench model`: transformers' own implementation of our model's architecture,
holding our weights, in its documented fast configuration (float32, `attn_implementation=
"sdpa"`, training mode with no dropout), with the same cross-entropy over its logits."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.config import ModelConfig
from paratrain.models.hf import HF_ARCHS, to_hf, to_hf_config

PEER_CONFIG = "transformers {version}, {cls}, attn_implementation=sdpa, float32, dropout 0"


class CausalLMLoss(nn.Module):
    """A transformers causal LM called as ours is: (ids, targets) -> the mean token loss.
    Targets are already shifted (our batches), so no labels are passed to the model."""

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.hf = hf_model

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.hf(input_ids=ids).logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def transformers_twin(model_cfg: ModelConfig, ours: nn.Module) -> tuple[CausalLMLoss, str]:
    """transformers' model of the same architecture and shape holding `ours`'s weights,
    and a line that says what it is."""
    import transformers

    fields: dict[str, Any] = dict(to_hf_config(model_cfg))
    model_type = fields.pop("model_type")
    for special in ("bos_token_id", "eos_token_id"):  # GPT-2's 50256 may be outside ours
        fields.setdefault(special, None)
    cls = getattr(transformers, HF_ARCHS["gpt2" if model_cfg.arch == "gpt" else "llama"])
    # transformers takes attn_implementation through **kwargs; its signature does not say so.
    make = transformers.CONFIG_MAPPING[model_type]
    config = make(**fields, attn_implementation="sdpa")  # type: ignore[call-arg]
    hf = cls(config).float().train()
    state = to_hf(model_cfg.arch, model_cfg.n_layer, model_cfg.tie_embeddings, ours.state_dict())
    missing, unexpected = hf.load_state_dict(state, strict=False)
    tied_head = ["lm_head.weight"] if model_cfg.tie_embeddings else []
    if unexpected or sorted(missing) != tied_head:
        raise RuntimeError(f"weights do not fit {cls.__name__}: {missing or unexpected}")
    if hf.config._attn_implementation != "sdpa":
        raise RuntimeError(f"{cls.__name__} runs {hf.config._attn_implementation}, not sdpa")
    line = PEER_CONFIG.format(version=transformers.__version__, cls=cls.__name__)
    return CausalLMLoss(hf), line
