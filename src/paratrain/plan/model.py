"""What the planner knows about a model: its parameter count and, if given, its shape.

A parameter count alone is enough for model-state memory and gradient traffic; the shape
(layers, hidden size, heads, vocabulary, sequence length) is what activation memory and
tensor- and pipeline-parallel traffic are counted from. Presets carry the nominal count
the literature and the seeds use (7B means N = 7e9 exactly, so the seeds' worked examples
reproduce to the digit) together with the published shape of a model of that size.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from paratrain.config import ModelConfig, TrainConfig
from paratrain.models.presets import MODEL_PRESETS as TRAIN_PRESETS
from paratrain.models.presets import ffn_width, kv_heads, param_count, preset
from paratrain.plan import moe


@dataclass(frozen=True)
class Shape:
    """A ModelSpec's whole shape (`ModelSpec.shape`): every dimension the counts read."""

    arch: str
    n_layer: int
    d_model: int
    n_head: int
    n_kv_head: int
    vocab_size: int
    seq_len: int
    max_seq_len: int
    ffn_hidden: int
    tie_embeddings: bool


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer as the planner sees it.

    `n_params` is the parameter count N; when None it is counted from the shape
    (models/presets.py `param_count`: our GPT, or our Llama with `arch` "llama").
    `arch`, `n_kv_head`, `ffn_hidden` and `tie_embeddings` are read as config.ModelConfig
    has them (0: n_head key/value heads; the architecture's default MLP width).

    A mixture of experts (`num_experts` > 0, plan/moe.py) replaces every block's MLP by
    that many SwiGLU experts of width `expert_ffn` (0: ffn_hidden), `top_k` per token, a
    router (h x E) and an optional shared expert of width `shared_ffn`; `capacity_factor`
    caps each expert's load (None: no token dropped). Counted for the Llama architecture.
    """

    name: str
    n_params: int | None = None
    n_layer: int | None = None
    d_model: int | None = None
    n_head: int | None = None
    vocab_size: int | None = None
    seq_len: int | None = None  # tokens per training sequence
    max_seq_len: int | None = None  # rows of the position embedding; default seq_len
    arch: str = "gpt"
    n_kv_head: int = 0
    ffn_hidden: int = 0
    tie_embeddings: bool = False
    num_experts: int = 0  # 0: a dense model
    top_k: int = 2
    expert_ffn: int = 0
    shared_ffn: int = 0
    capacity_factor: float | None = None

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
        if self.has_shape and self.shape.d_model % self.shape.n_head:
            raise ValueError(
                f"model {self.name}: heads {self.n_head} do not divide hidden {self.d_model}"
            )
        if self.num_experts:
            moe.check_moe(self)

    @property
    def has_shape(self) -> bool:
        """True when activations and TP/PP traffic can be counted."""
        shape = (self.n_layer, self.d_model, self.n_head, self.vocab_size, self.seq_len)
        return all(v is not None for v in shape)

    @property
    def shape(self) -> Shape:
        """The whole shape; only for a model that has one (`has_shape`)."""
        n_layer, h, n_head, vocab, seq = (
            self.n_layer, self.d_model, self.n_head, self.vocab_size, self.seq_len
        )  # fmt: skip
        if n_layer is None or h is None or n_head is None or vocab is None or seq is None:
            raise ValueError(f"model {self.name}: counting this needs the model's shape")
        return Shape(
            self.arch, n_layer, h, n_head, self.n_kv_head, vocab, seq,
            self.max_seq_len or seq, self.ffn_hidden, self.tie_embeddings,
        )  # fmt: skip

    @property
    def active_params(self) -> int:
        """Parameters one token passes through: N for a dense model."""
        return moe.active_params(self) if self.num_experts else self.params

    @property
    def params(self) -> int:
        """N, the parameter count."""
        if self.n_params is not None:
            return self.n_params
        if self.num_experts:
            return moe.total_params(self)
        return param_count(self.shape)

    def parts(self, tp: int) -> ModelParts:
        """Parameters per block and at each end, split over tp or replicated (see
        `ModelParts`), as the model's tensor-parallel plan (models/plans.py) splits them:
        `tensors`' sums."""
        t = self.tensors(tp)
        block, first, last = (ModelParts.Part(sum(n for n, split in place if split),
                                              sum(n for n, split in place if not split))
                              for place in (t.block, t.first, t.last))  # fmt: skip
        return ModelParts(block, first, last, self.tie_embeddings)

    def tensors(self, tp: int) -> ModelTensors:
        """Each parameter tensor on one tp rank, in the model's registration order (the
        order the data-parallel wrappers bucket them in): (elements, split over tp)."""
        shape = self.shape
        h, v, t = shape.d_model, shape.vocab_size, tp
        table = (v * h // t, True)  # the vocabulary-split token table, or the head
        if self.arch == "gpt":
            # ln1, q k v with biases, proj (its bias whole), ln2, fc with bias, proj
            # (its bias whole): the column-parallel layers' biases split with them.
            w, b, norm = (h * h // t, True), (h // t, True), [(h, False), (h, False)]
            fc = (4 * h * h // t, True)
            block = [*norm, w, b, w, b, w, b, w, (h, False), *norm, fc, (4 * h // t, True),
                     fc, (h, False)]  # fmt: skip
            first, last = [table, (shape.max_seq_len * h, False)], [*norm, table]
        else:  # llama: no biases; RMSNorms h each, replicated
            d_kv, f = kv_heads(shape) * (h // shape.n_head), ffn_width(shape)
            q, kv, ffn = (h * h // t, True), (h * d_kv // t, True), (h * f // t, True)
            block = [(h, False), q, kv, kv, q, (h, False), ffn, ffn, ffn]
            first, last = [table], [(h, False), table]
        return ModelTensors(tuple(block), tuple(first), tuple(last))


@dataclass(frozen=True)
class ModelTensors:
    """`ModelSpec.tensors`: per block and at each end, (elements on one tp rank, split)."""

    block: tuple[tuple[int, bool], ...]
    first: tuple[tuple[int, bool], ...]
    last: tuple[tuple[int, bool], ...]


@dataclass(frozen=True)
class ModelParts:
    """A model's parameters on one tp rank, by place: per block, the first virtual stage's
    (embeddings), the last one's (final norm and head). Each splits into `split` (this
    rank's slice of what tensor parallelism slices) and `replicated` (whole on every tp
    rank). With tied embeddings the head is the token table: counted once when one rank
    holds both ends, and on each end's rank when a pipeline puts them apart (both hold a
    copy, their gradients summed between them)."""

    @dataclass(frozen=True)
    class Part:
        split: int
        replicated: int

        @property
        def total(self) -> int:
            return self.split + self.replicated

    block: Part
    first: Part
    last: Part
    tied: bool

    def ends(self, first: bool, last: bool) -> int:
        """Parameters of the ends a virtual stage holds (one rank's share)."""
        n = (self.first.total if first else 0) + (self.last.total if last else 0)
        if first and last and self.tied:
            n -= self.last.split  # the head is the token table: one parameter
        return n

    def ends_replicated(self, first: bool, last: bool) -> int:
        return (self.first.replicated if first else 0) + (self.last.replicated if last else 0)


def gpt_param_count(n_layer: int, d_model: int, vocab_size: int, max_seq_len: int) -> int:
    """Exact parameter count of our GPT with an untied head (models/presets.py
    `param_count`): per block 12 d^2 + 13 d; ends (2 V + T_max) d + 2 d."""
    shape = ModelConfig(n_layer=n_layer, d_model=d_model, vocab_size=vocab_size)
    return param_count(replace(shape, max_seq_len=max_seq_len))


def spec_of(m: ModelConfig, seq_len: int, name: str = "paratrain") -> ModelSpec:
    """A [model] config (our GPT or Llama) as the planner takes it, at this sequence length."""
    return ModelSpec(
        name,
        # A mixture of experts: counted exactly here; the planner's formulas are dense.
        n_params=param_count(m) if m.num_experts else None,
        n_layer=m.n_layer,
        d_model=m.d_model,
        n_head=m.n_head,
        vocab_size=m.vocab_size,
        seq_len=seq_len,
        max_seq_len=m.max_seq_len,
        arch=m.arch,
        n_kv_head=m.n_kv_head,
        ffn_hidden=m.ffn_hidden,
        tie_embeddings=m.tie_embeddings,
    )


def _ours() -> ModelSpec:
    return spec_of(ModelConfig(), TrainConfig().seq_len)


def _shared(name: str) -> ModelSpec:
    """A preset of `paratrain train --model` (models/presets.py), counted from its shape,
    at the default sequence length for the tiny ones and the longest for the others."""
    fields = {**preset(name), "name": name}
    m = replace(ModelConfig(), **fields)
    seq_len = TrainConfig().seq_len if m.max_seq_len <= 256 else m.max_seq_len
    return spec_of(m, seq_len, name)


# Shapes: GPT-3 table 2.1 (arXiv:2005.14165) for 1.3B, 13B, 175B; LLaMA (arXiv:2302.13971)
# for 7B; Llama 2 (arXiv:2307.09288) for 70B. N is the nominal size. Mixtral 8x7B: Jiang
# et al., "Mixtral of Experts", arXiv:2401.04088, table 1 (dim 4096, 32 layers, 32 heads,
# 8 kv heads, hidden 14336, vocabulary 32000, context 32768, 8 experts, top 2); counted
# from the shape: 46,702,792,704 parameters, 12,879,925,248 active (Mistral AI: 46.7B and
# 12.9B).
MODEL_PRESETS: dict[str, ModelSpec] = {
    "paratrain": _ours(),
    **{name: _shared(name) for name in TRAIN_PRESETS},
    "1.3b": ModelSpec("1.3b", int(1.3e9), 24, 2048, 16, 50257, 2048),
    "7b": ModelSpec("7b", int(7e9), 32, 4096, 32, 32000, 2048),
    "13b": ModelSpec("13b", int(13e9), 40, 5120, 40, 50257, 2048),
    "70b": ModelSpec("70b", int(70e9), 80, 8192, 64, 32000, 4096),
    "175b": ModelSpec("175b", int(175e9), 96, 12288, 96, 50257, 2048),
    "mixtral-8x7b": ModelSpec(
        "mixtral-8x7b", None, 32, 4096, 32, 32000, 32768, arch="llama", n_kv_head=8,
        ffn_hidden=14336, num_experts=8, top_k=2,
    ),
}  # fmt: skip


def model_preset(name: str) -> ModelSpec:
    if name not in MODEL_PRESETS:
        raise ValueError(f"unknown model preset {name!r}; valid: {', '.join(MODEL_PRESETS)}")
    return MODEL_PRESETS[name]


def with_overrides(spec: ModelSpec, **changes: int | float | None) -> ModelSpec:
    """The spec with every non-None change applied (the CLI's flags over a preset).

    A changed shape drops the preset's nominal count unless a count is given too, so that
    `--preset 7b --layers 16` is a 16-layer model, not a 7e9-parameter one.
    """
    # Each value of its field's type (the CLI's flags); replace checks the names.
    given: dict[str, Any] = {k: v for k, v in changes.items() if v is not None}
    if not given:
        return spec
    if "n_params" not in given and set(given) - {"seq_len"}:
        given["n_params"] = None
    return replace(spec, name=spec.name + "*", **given)
