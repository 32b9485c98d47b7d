"""Tensor parallelism applied from outside: a plan of module-name patterns -> styles.

    model = GPT(cfg)                                    # full model, same seed on every rank
    apply_tensor_parallel(model, GPT_TP_PLAN, mesh.group("tp"), sequence_parallel=True)

A plan is data, in the spirit of DTensor's `parallelize_module`: `{"blocks.*.mlp.fc":
"colwise", ...}`, where `*` matches one component of a module name. Each style (see
STYLES) replaces the module by its tensor-parallel layer, sliced from the full one, or
adds forward hooks to it; module and parameter names do not change, so the state dict of
a tensor-parallel model has the plain model's keys (with split tensors).

The Megatron-LM layout (arXiv:1909.08053, section 3) for a transformer block:

    x -> LN -> f -> [q k v: colwise] -> attention on local heads -> [proj: rowwise] -> g -> +
    x -> LN -> f -> [fc: colwise] -> gelu -> [proj: rowwise] -> g -> +

so each block does two all-reduces in forward (g) and two in backward (f), and none inside
attention. `f` for q, k and v is applied once, on the attention module's input (the
"attention" style), not three times. With `sequence_parallel` (arXiv:2205.05198) the
LayerNorm and dropout regions hold only this rank's T/tp tokens, f becomes an all-gather
along the sequence (backward: reduce-scatter) and g a reduce-scatter (backward:
all-gather): the same bytes, and the replicated activations are no longer stored tp times.

Dropout: `seed` seeds an RngTracker; replicated regions draw the same mask on every tp
rank, split regions (attention heads; everything under sequence parallelism) draw a
different one per rank. Every dropout layer must be covered by the plan, or its mask
would depend on the process's own random state.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from paratrain.comm import compat, regions
from paratrain.comm.group import CommGroup
from paratrain.module_names import matching
from paratrain.parallel.lora import LoraLinear, split_lora
from paratrain.parallel.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    shard_size,
)
from paratrain.parallel.tensor_parallel.loss import VocabParallelCrossEntropy
from paratrain.parallel.tensor_parallel.rng import (
    REPLICATED,
    SPLIT,
    RngTracker,
    fork_during_forward,
)
from paratrain.parallel.tensor_parallel.state import (
    full_state_dict,
    sequence_parallel_parameters,
    sharded_parameters,
)

STYLES: dict[str, str] = {
    "colwise": "nn.Linear -> ColumnParallelLinear: output split by features",
    "colwise_gathered": "nn.Linear -> ColumnParallelLinear: output gathered on every rank",
    "rowwise": "nn.Linear -> RowParallelLinear: input split by features, outputs summed",
    "vocab_embedding": "nn.Embedding -> VocabParallelEmbedding: table split by vocabulary",
    "vocab_head": "nn.Linear over the vocabulary -> ColumnParallelLinear: logits stay split",
    "vocab_loss": "nn.CrossEntropyLoss -> VocabParallelCrossEntropy on split logits",
    "attention": "input enters the split region once (f) for its colwise layers; heads split",
    "split_region": "input enters the split region once (f) for its colwise layers (SwiGLU)",
    "replicated": "whole on every rank; with sequence parallelism, on this rank's tokens",
    "split": "runs on split activations: its dropout masks differ per rank",
}

__all__ = [
    "STYLES",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "RngTracker",
    "VocabParallelCrossEntropy",
    "VocabParallelEmbedding",
    "apply_tensor_parallel",
    "full_state_dict",
    "sequence_parallel_parameters",
    "sharded_parameters",
]


def apply_tensor_parallel(
    model: nn.Module,
    plan: Mapping[str, str],
    group: CommGroup,
    *,
    sequence_parallel: bool = False,
    seed: int = 0,
) -> nn.Module:
    """Make `model` tensor parallel over `group` in place, following `plan`; return it.

    Every tp rank must have built the same full model (same seed) and call this with the
    same plan. Raises ValueError, naming the module and the sizes, when a pattern matches
    nothing, a module matches two patterns, a size is not divisible by tp, or a dropout
    layer is not covered.
    """
    matches = match_plan(model, plan)
    tied = _tied_names(model)  # before the styles make new parameters of the slices
    tracker = RngTracker(seed, group.rank)
    regions_ = [n for n, style in matches.items() if style in ("attention", "split_region")]
    for name, style in matches.items():
        module = model.get_submodule(name)
        inside_region = any(name.startswith(a + ".") for a in regions_)
        try:
            new = _apply_style(module, style, group, tracker, sequence_parallel, inside_region)
        except ValueError as e:
            raise ValueError(f"tensor parallel plan: {name} ({style}): {e}") from None
        if new is not module:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, new)
    _check_dropout_covered(model, matches)
    _tie_again(model, tied)
    # Its states are part of a checkpoint. (torch types Module.__setattr__ for tensors and
    # modules only; any attribute is allowed.)
    model.tp_rng_tracker = tracker  # type: ignore[assignment]
    return model


def _tied_names(model: nn.Module) -> list[list[tuple[str, str]]]:
    """(module name, attribute) of each parameter that more than one module holds."""
    holders: dict[int, list[tuple[str, str]]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for attr, p in module.named_parameters(recurse=False):
            holders.setdefault(id(p), []).append((name, attr))
    return [names for names in holders.values() if len(names) > 1]


def _tie_again(model: nn.Module, tied: list[list[tuple[str, str]]]) -> None:
    """Each style sliced its module's parameter into a new one, so a tied weight (the
    token embedding and the output head) became two: make them one again. Both must be
    the same slice of the same tensor (split along the same dimension), or the plan
    splits the tie apart, which is refused."""
    for names in tied:
        holders = [(model.get_submodule(m), attr) for m, attr in names]
        first = getattr(*holders[0])
        dim = getattr(holders[0][0], "tp_shard_dims", {}).get(holders[0][1])
        for (module, attr), (m, _) in zip(holders[1:], names[1:], strict=True):
            p = getattr(module, attr)
            same_split = getattr(module, "tp_shard_dims", {}).get(attr) == dim
            if p is not first and not (
                same_split and p.shape == first.shape and torch.equal(p, first)
            ):
                raise ValueError(
                    f"tensor parallel plan splits the tied parameter {names[0][0]}."
                    f"{names[0][1]} and {m}.{attr} differently; give both the same split"
                )
            setattr(module, attr, first)


def match_plan(model: nn.Module, plan: Mapping[str, str]) -> dict[str, str]:
    """{module name: style} for every module a pattern names (module_names.py's grammar)."""
    matches: dict[str, str] = {}
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ValueError(
                f"tensor parallel plan: {pattern!r}: unknown style {style!r}; "
                f"valid: {', '.join(STYLES)}"
            )
        hits = matching(model, pattern)
        if not hits:
            raise ValueError(f"tensor parallel plan: {pattern!r} matches no module of the model")
        for name in hits:
            if name in matches:
                raise ValueError(f"tensor parallel plan: {name} is matched by two patterns")
            matches[name] = style
    return matches


def _apply_style(
    module: nn.Module,
    style: str,
    group: CommGroup,
    tracker: RngTracker,
    sp: bool,
    inside_region: bool,
) -> nn.Module:
    if style in ("colwise", "colwise_gathered", "vocab_head", "rowwise"):
        full = _expect(module, nn.Linear, style)
        layer = _linear_style(full, style, group, sp, inside_region)
        if isinstance(full, LoraLinear):  # adapters split with the base (parallel/lora.py)
            kind = "rowwise" if style == "rowwise" else "colwise"
            split_lora(full, layer, kind, group.rank, group.size)
        return layer
    if style == "vocab_embedding":
        return VocabParallelEmbedding(
            _expect(module, nn.Embedding, style), group, sequence_parallel=sp
        )
    if style == "vocab_loss":
        return VocabParallelCrossEntropy.from_loss(module, group)
    if style in ("attention", "split_region"):
        _make_attention_region(module, group, tracker, sp)
    elif style == "split":
        if _draws(module):
            fork_during_forward(module, tracker, SPLIT)
    else:
        _make_replicated(module, group, tracker, sp)
    return module


def _linear_style(
    full: nn.Linear, style: str, group: CommGroup, sp: bool, inside_region: bool
) -> nn.Module:
    if style == "rowwise":
        return RowParallelLinear(full, group, sequence_parallel=sp)
    if style == "vocab_head":
        shard_size(full.out_features, group, "vocabulary")
    gather = style == "colwise_gathered"
    return ColumnParallelLinear(
        full, group, gather_output=gather, shared_input=inside_region, sequence_parallel=sp
    )


def _expect(module: nn.Module, kind: type, style: str) -> Any:
    if not isinstance(module, kind):
        raise ValueError(f"style {style} applies to {kind.__name__}, not {type(module).__name__}")
    return module


def _make_attention_region(
    module: nn.Module, group: CommGroup, tracker: RngTracker, sp: bool
) -> None:
    """One f (or sequence all-gather) on the input for the colwise layers inside (q, k and
    v; SwiGLU's gate and up); attention heads, and key/value heads, split by rank."""
    heads = getattr(module, "n_head", getattr(module, "num_heads", None))
    if heads is not None:
        shard_size(heads, group, "number of attention heads")
    kv_heads = getattr(module, "n_kv_head", None)
    if kv_heads is not None:
        shard_size(kv_heads, group, "number of key/value heads")
    # Registered first, so that the random state is swapped before anything else runs
    # and restored after: attention dropout acts on this rank's heads only.
    if _draws(module):
        fork_during_forward(module, tracker, SPLIT)

    def enter_region(mod: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x, *rest = args
        x = regions.gather_sequence(x, group) if sp else regions.f(x, group)  # (B, T, C)
        return (x, *rest)

    module.register_forward_pre_hook(enter_region)


def _make_replicated(module: nn.Module, group: CommGroup, tracker: RngTracker, sp: bool) -> None:
    """Replicated parameters; under sequence parallelism the module sees T/tp tokens."""
    if _draws(module):
        # Sequence parallelism splits the replicated activations: different tokens per
        # rank, so different masks.
        fork_during_forward(module, tracker, SPLIT if sp else REPLICATED)
    if not sp:
        return
    for m in module.modules():
        names = tuple(n for n, _ in m.named_parameters(recurse=False))
        m.sequence_parallel_params = names  # type: ignore[assignment]  # (as tp_rng_tracker)
    if isinstance(module, nn.Embedding):
        # A replicated embedding (positions) looks up only this rank's part of the
        # sequence, the last dimension of its ids, to match the split activations.
        def local_ids(mod: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            ids, *rest = args
            n = shard_size(ids.shape[-1], group, "sequence length")
            return (ids.narrow(-1, group.rank * n, n), *rest)  # (..., T/tp)

        module.register_forward_pre_hook(local_ids)


def _draws(module: nn.Module) -> bool:
    """Whether a forward of `module` draws random numbers (dropout above 0, as a layer or
    as attention's `dropout` rate). Only then does its region need its own stream: a fork
    without draws changes nothing, and under --compile each fork is a graph break."""
    for m in module.modules():
        if isinstance(m, compat.DropoutBase) and m.p > 0:
            return True
        rate: object = getattr(m, "dropout", None)
        if isinstance(rate, float | int) and rate > 0:
            return True
    return False


def _check_dropout_covered(model: nn.Module, matches: dict[str, str]) -> None:
    covered = [n for n, s in matches.items() if s in ("replicated", "split", "attention")]
    for name, module in model.named_modules():
        if not isinstance(module, compat.DropoutBase):
            continue
        if not any(name == c or name.startswith(c + ".") for c in covered):
            raise ValueError(
                f"tensor parallel plan: dropout layer {name} is not covered; mark it "
                "'replicated' or 'split' so that every tp rank draws the right mask"
            )
