"""What the planner knows about a model: its parameter count and, if given, its shape.

A parameter count alone is enough for model-state memory and gradient traffic; the shape
(layers, hidden size, heads, vocabulary, sequence length) is what activation memory and
tensor- and pipeline-parallel traffic are counted from. Presets carry the nominal count
the literature and the seeds use (7B means N = 7e9 exactly, so the seeds' worked examples
reproduce to the digit) together with the published shape of a model of that size.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from paratrain.config import ModelConfig, TrainConfig


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer as the planner sees it.

    `n_params` is the parameter count N; when None it is counted from the shape with
    `gpt_param_count` (our GPT: untied head, learned positions, biases, LayerNorm).
    """

    name: str
    n_params: int | None = None
    n_layer: int | None = None
    d_model: int | None = None
    n_head: int | None = None
    vocab_size: int | None = None
    seq_len: int | None = None  # tokens per training sequence
    max_seq_len: int | None = None  # rows of the position embedding; default seq_len

    def __post_init__(self) -> None:
        for name in ("n_params", "n_layer", "d_model", "n_head", "vocab_size", "seq_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"model {self.name}: {name} = {value}; must be at least 1")
        if self.n_params is None and not self.has_shape:
            raise ValueError(
                f"model {self.name}: give a parameter count (--params) or the whole shape "
                "(--layers --hidden --heads --vocab --seq-len)"
            )
        if self.has_shape and self.d_model % self.n_head:  # type: ignore[operator]
            raise ValueError(
                f"model {self.name}: heads {self.n_head} do not divide hidden {self.d_model}"
            )

    @property
    def has_shape(self) -> bool:
        """True when activations and TP/PP traffic can be counted."""
        shape = (self.n_layer, self.d_model, self.n_head, self.vocab_size, self.seq_len)
        return all(v is not None for v in shape)

    @property
    def params(self) -> int:
        """N, the parameter count."""
        if self.n_params is not None:
            return self.n_params
        return gpt_param_count(
            self.n_layer,  # type: ignore[arg-type]
            self.d_model,  # type: ignore[arg-type]
            self.vocab_size,  # type: ignore[arg-type]
            self.max_seq_len or self.seq_len,  # type: ignore[arg-type]
        )


def gpt_param_count(n_layer: int, d_model: int, vocab_size: int, max_seq_len: int) -> int:
    """Exact parameter count of `paratrain.models.gpt.GPT` (checked against the module).

    Per block: LayerNorms 2 * 2d, q/k/v/proj 4 (d^2 + d), MLP fc d*4d + 4d and proj
    4d*d + d: 12 d^2 + 13 d. Ends: token embedding V d, positions T_max d, final
    LayerNorm 2d, head V d (no bias, not tied). For large d this is the familiar 12 L d^2.
    """
    d = d_model
    return n_layer * (12 * d * d + 13 * d) + 2 * vocab_size * d + max_seq_len * d + 2 * d


def spec_of(m: ModelConfig, seq_len: int) -> ModelSpec:
    """Our GPT's shape (a [model] config) as the planner takes it, at this sequence length."""
    return ModelSpec(
        "paratrain",
        n_layer=m.n_layer,
        d_model=m.d_model,
        n_head=m.n_head,
        vocab_size=m.vocab_size,
        seq_len=seq_len,
        max_seq_len=m.max_seq_len,
    )


def _ours() -> ModelSpec:
    return spec_of(ModelConfig(), TrainConfig().seq_len)


# Shapes: GPT-3 table 2.1 (arXiv:2005.14165) for 1.3B, 13B, 175B; LLaMA (arXiv:2302.13971)
# for 7B; Llama 2 (arXiv:2307.09288) for 70B. N is the nominal size.
MODEL_PRESETS: dict[str, ModelSpec] = {
    "paratrain": _ours(),
    "1.3b": ModelSpec("1.3b", int(1.3e9), 24, 2048, 16, 50257, 2048),
    "7b": ModelSpec("7b", int(7e9), 32, 4096, 32, 32000, 2048),
    "13b": ModelSpec("13b", int(13e9), 40, 5120, 40, 50257, 2048),
    "70b": ModelSpec("70b", int(70e9), 80, 8192, 64, 32000, 4096),
    "175b": ModelSpec("175b", int(175e9), 96, 12288, 96, 50257, 2048),
}


def model_preset(name: str) -> ModelSpec:
    if name not in MODEL_PRESETS:
        raise ValueError(f"unknown model preset {name!r}; valid: {', '.join(MODEL_PRESETS)}")
    return MODEL_PRESETS[name]


def with_overrides(spec: ModelSpec, **changes: int | None) -> ModelSpec:
    """The spec with every non-None change applied (the CLI's flags over a preset).

    A changed shape drops the preset's nominal count unless a count is given too, so that
    `--preset 7b --layers 16` is a 16-layer model, not a 7e9-parameter one.
    """
    given = {k: v for k, v in changes.items() if v is not None}
    if not given:
        return spec
    if "n_params" not in given and set(given) - {"seq_len"}:
        given["n_params"] = None
    return replace(spec, name=spec.name + "*", **given)
