"""How each model is split, as data: every fact a strategy needs about a model, in one place.

Pure data and arithmetic (no distributed code, not even torch). The strategies take these
as arguments and never import a model: train/build.py hands `GPT_PLAN.tensor_parallel` to
`apply_tensor_parallel`, `fsdp_units` to `FullyShardedDataParallel`, `pipeline_*` to
`split_into_stages` and `recompute_units` to `apply_recomputation`; the configuration
checks read them before any worker starts.

The tensor-parallel plan is Megatron-LM's layout (arXiv:1909.08053, section 3):
q, k, v column-parallel so each rank owns whole heads and attention needs no
communication; the attention output projection row-parallel; the MLP up-projection
column-parallel, the down-projection row-parallel; the token embedding and the LM head
split by vocabulary, with a cross-entropy that never gathers the logits. LayerNorms,
position embeddings and dropout stay replicated: a LayerNorm normalises each token over
the hidden dimension, and its input (the residual stream) is whole on every rank, so
there is nothing to split (the seeds' FAQ Q19 worries about statistics over a split
hidden dimension, which this layout never creates). Under sequence parallelism the same
"replicated" entries run on this rank's T/tp tokens, which is also exact, since the
statistics are per token.

The Llama plan is the same layout with grouped-query attention and SwiGLU: q, k and v
column-parallel split whole heads (n_head / tp query heads and n_kv_head / tp key/value
heads per rank, which keeps every query head with its key/value head, since heads are
grouped contiguously), so tp must divide n_kv_head too (Megatron-LM replicates key/value
heads instead when it does not; refused here); the SwiGLU gate and up projections
column-parallel behind one f (the "split_region" style), down row-parallel; RMSNorms
replicated like LayerNorms. Rotary positions have no parameters and are computed inside
attention, which always sees the whole sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

GPT_TP_PLAN: dict[str, str] = {
    "tok_emb": "vocab_embedding",
    "pos_emb": "replicated",
    "drop": "replicated",
    "blocks.*.ln1": "replicated",
    "blocks.*.attn": "attention",  # f once for q, k, v; heads split; attention dropout
    "blocks.*.attn.q": "colwise",
    "blocks.*.attn.k": "colwise",
    "blocks.*.attn.v": "colwise",
    "blocks.*.attn.proj": "rowwise",
    "blocks.*.ln2": "replicated",
    "blocks.*.mlp.fc": "colwise",
    "blocks.*.mlp.proj": "rowwise",
    "blocks.*.drop": "replicated",
    "norm": "replicated",
    "head": "vocab_head",
    "loss_fn": "vocab_loss",
}


LLAMA_TP_PLAN: dict[str, str] = {
    "tok_emb": "vocab_embedding",
    "blocks.*.attn_norm": "replicated",
    "blocks.*.attn": "attention",
    "blocks.*.attn.q": "colwise",
    "blocks.*.attn.k": "colwise",
    "blocks.*.attn.v": "colwise",
    "blocks.*.attn.o": "rowwise",
    "blocks.*.mlp_norm": "replicated",
    "blocks.*.mlp": "split_region",  # f once for gate and up
    "blocks.*.mlp.gate": "colwise",
    "blocks.*.mlp.up": "colwise",
    "blocks.*.mlp.down": "rowwise",
    "norm": "replicated",
    "head": "vocab_head",
    "loss_fn": "vocab_loss",
}


def _moe_tp_plan(plan: dict[str, str]) -> dict[str, str]:
    """The TP plan with every block's MLP a mixture of experts: the MoE stays whole on every
    tp rank (its input, the residual stream, is whole there), so each tp rank routes the
    same tokens and runs the same experts; expert parallelism splits it instead (over ep)."""
    dense = {k: v for k, v in plan.items() if not k.startswith("blocks.*.mlp")}
    return {**dense, "blocks.*.mlp": "replicated"}


GPT_MOE_TP_PLAN = _moe_tp_plan(GPT_TP_PLAN)
LLAMA_MOE_TP_PLAN = _moe_tp_plan(LLAMA_TP_PLAN)


class _Shape(Protocol):  # GPTConfig, LlamaConfig or config.ModelConfig, without torch
    vocab_size: int
    n_head: int
    d_model: int


def check_tensor_parallel(
    cfg: _Shape, tp: int, seq_len: int | None = None, sequence_parallel: bool = False
) -> None:
    """Raise ValueError, naming the sizes, if the model's plan cannot split it over tp.

    Heads must divide so each rank owns whole heads (key/value heads too, for grouped-query
    attention); the vocabulary so each rank owns an equal slice of the embedding and the
    head; with sequence parallelism, the sequence. (The hidden size then divides too:
    d_model = n_head * head_dim.)
    """
    problems = []
    if cfg.n_head % tp:
        problems.append(f"{cfg.n_head} attention heads")
    kv = getattr(cfg, "n_kv_head", 0) or cfg.n_head
    if kv != cfg.n_head and kv % tp:  # grouped-query attention: key/value heads split too
        problems.append(f"{kv} key/value heads")
    if cfg.d_model % tp:
        problems.append(f"d_model {cfg.d_model}")
    if cfg.vocab_size % tp:
        problems.append(f"vocabulary {cfg.vocab_size}")
    if sequence_parallel and seq_len is not None and seq_len % tp:
        problems.append(f"sequence length {seq_len} (sequence parallel)")
    if problems:
        raise ValueError(f"tensor parallel tp={tp} must divide: {', '.join(problems)}")


def check_context_parallel(
    cfg: _Shape, cp: int, method: str, tp: int, seq_len: int, sequence_parallel: bool
) -> None:
    """Raise ValueError, naming the sizes, if the sequence or the heads cannot split over cp.

    ring: the load-balanced layout cuts the sequence into 2·cp equal chunks; alltoall: the
    plain layout into cp, and each rank's heads (after tp) split over cp again, query and
    key/value heads alike. With sequence parallelism each rank's s/cp tokens split over tp.
    """
    chunks = 2 * cp if method == "ring" else cp
    if seq_len % chunks:
        raise ValueError(
            f"--cp {cp} --cp-method {method}: sequence length {seq_len} must be divisible by "
            f"{chunks} ({'2·cp load-balanced chunks' if method == 'ring' else 'cp chunks'})"
        )
    if sequence_parallel and (seq_len // cp) % tp:
        raise ValueError(
            f"--cp {cp} with --sequence-parallel: each rank's {seq_len // cp} tokens "
            f"(sequence {seq_len} / cp) must be divisible by tp = {tp}"
        )
    kv = getattr(cfg, "n_kv_head", 0) or cfg.n_head
    heads = {"query": cfg.n_head // tp, "key/value": kv // tp}
    bad = [f"{n} {kind} heads" for kind, n in heads.items() if n % cp]
    if method == "alltoall" and bad:
        raise ValueError(
            f"--cp {cp} --cp-method alltoall splits each rank's heads (after tp = {tp}) over "
            f"cp: {' and '.join(bad)} not divisible by {cp}; use --cp-method ring"
        )


# FSDP / ZeRO-3 units (paratrain.parallel.data_parallel.fsdp): each entry is one unit whose
# parameters are gathered together just before its forward (and its backward) and freed right after.
# "blocks.*" expands to one unit per block, in order; the embeddings and the final norm
# with the head are a unit each. Parameters named by no unit form a root unit.
GPT_FSDP_UNITS: tuple[tuple[str, ...], ...] = (
    ("tok_emb", "pos_emb"),
    ("blocks.*",),
    ("norm", "head"),
)
LLAMA_FSDP_UNITS: tuple[tuple[str, ...], ...] = (("tok_emb",), ("blocks.*",), ("norm", "head"))


@dataclass(frozen=True)
class ModelPlan:
    """Everything the strategies need to know about a model, as module names: patterns in
    module_names.py's grammar, where `*` is one name component ("blocks.*.mlp").

    tensor_parallel: module-name pattern -> style (parallel/tensor_parallel/apply.py: STYLES).
    fsdp_units: the FSDP / ZeRO-3 units, in forward order ("x.*": one unit per child).
    pipeline_blocks: the nn.ModuleDict of blocks the pipeline cuts into stages;
    pipeline_first / pipeline_last: the modules only the first / last stage holds.
    recompute_units: the modules whose activations are recomputed in backward.
    context_attention: the core attention modules (models/position_dependent.py) that context
    parallelism replaces by ring or all-to-all attention; context_positions: the
    positions modules it replaces by those of this rank's chunks of the sequence.
    compile_units: the modules compiled one by one under --compile (regional compilation).
    moe_layers: with --num-experts, the mixture-of-experts layers (models/moe.py), whose
        `experts` child stacks each parameter by expert along dimension 0: what expert
        parallelism splits, and what the data-parallel wrappers reduce over the expert-dp
        group instead of dp (parallel/expert_parallel/); moe_tensor_parallel: the TP plan
        then (the MoE replicated).
    muon_matrices: the modules whose `weight` is a hidden matrix, which `--optimizer muon`
        orthogonalizes (attention and MLP projections); everything else (embeddings, the
        head, norms, biases, routers, stacked experts) stays with AdamW.
    lora_targets: the linear layers that `--lora-rank` gives low-rank adapters when
        `--lora-targets` names none (attention and MLP projections: Hu et al.,
        arXiv:2106.09685, adapted attention only; QLoRA, arXiv:2305.14314, section 4,
        found every linear layer needed to match full fine-tuning).
    """

    tensor_parallel: dict[str, str]
    fsdp_units: tuple[tuple[str, ...], ...]
    pipeline_blocks: str
    pipeline_first: tuple[str, ...]
    pipeline_last: tuple[str, ...]
    recompute_units: tuple[str, ...]
    context_attention: str
    context_positions: str
    compile_units: tuple[str, ...] = ("blocks.*",)  # each block its own graph(s)
    moe_layers: str = "blocks.*.mlp"
    moe_tensor_parallel: dict[str, str] | None = None
    muon_matrices: tuple[str, ...] = ()
    lora_targets: tuple[str, ...] = ()


EXPERTS = "experts"  # the child of an MoE layer that holds its experts (models/moe.py)


# The hidden matrices of each block: what Muon orthogonalizes and LoRA adapts by default.
GPT_MATRICES = tuple(
    f"blocks.*.{m}" for m in ("attn.q", "attn.k", "attn.v", "attn.proj", "mlp.fc", "mlp.proj")
)
LLAMA_MATRICES = tuple(
    f"blocks.*.{m}"
    for m in ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.gate", "mlp.up", "mlp.down")
)


GPT_PLAN = ModelPlan(
    tensor_parallel=GPT_TP_PLAN,
    fsdp_units=GPT_FSDP_UNITS,
    pipeline_blocks="blocks",
    pipeline_first=("tok_emb", "pos_emb"),
    pipeline_last=("norm", "head"),
    recompute_units=("blocks.*",),  # each block keeps only its input (Megatron's "full")
    context_attention="blocks.*.attn.core",
    context_positions="positions",  # the learned absolute positions' indices
    moe_tensor_parallel=GPT_MOE_TP_PLAN,
    muon_matrices=GPT_MATRICES,
    lora_targets=GPT_MATRICES,
)

LLAMA_PLAN = ModelPlan(
    tensor_parallel=LLAMA_TP_PLAN,
    fsdp_units=LLAMA_FSDP_UNITS,
    pipeline_blocks="blocks",
    pipeline_first=("tok_emb",),
    pipeline_last=("norm", "head"),
    recompute_units=("blocks.*",),
    context_attention="blocks.*.attn.core",
    context_positions="blocks.*.attn.positions",  # each attention's rotary angles
    moe_tensor_parallel=LLAMA_MOE_TP_PLAN,
    muon_matrices=LLAMA_MATRICES,
    lora_targets=LLAMA_MATRICES,
)

PLANS: dict[str, ModelPlan] = {"gpt": GPT_PLAN, "llama": LLAMA_PLAN}  # by config.ARCHS


def lora_patterns(given: str, plan: ModelPlan) -> tuple[str, ...]:
    """The module-name patterns `--lora-targets` names (comma-separated), or the plan's."""
    patterns = tuple(p.strip() for p in given.split(",") if p.strip())
    return patterns or plan.lora_targets
