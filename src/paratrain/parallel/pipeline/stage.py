"""Cut a model into pipeline chunks: contiguous blocks, the embedding first, the head last.

Build full, then slice: every rank builds the whole model from the same seed and keeps
only its chunks, so all layouts start from identical weights and parameter names stay
those of the full model (`blocks.5.mlp.fc.weight`), which makes gathering and comparing
trivial. Blocks therefore live in an `nn.ModuleDict` keyed by their global index.

A chunk is a shallow copy of the model in which the blocks of other chunks are dropped and
the end modules it does not own are set to None. The model's own forward must accept that
(GPT's does): without the first modules it takes hidden states (B, T, C), without the last
it returns them, and with them `forward(x, targets)` returns the mean loss. Nothing in the
model knows about pipelines.

With S stages and v chunks per stage the blocks form S * v contiguous pieces; piece
`chunk * S + stage` goes to `stage` (arXiv:2104.04473, section 2.2.2).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from torch import nn

BALANCES = ("layers", "params")


@dataclass(frozen=True)
class PipelinePlan:
    """Where a model's parts go: attribute names on the model, top level (a model's own
    plan lives beside it, models/plans.py)."""

    blocks: str  # an nn.ModuleDict of blocks, in execution order
    first: tuple[str, ...] = ()  # only on virtual stage 0
    last: tuple[str, ...] = ()  # only on the last virtual stage


def _params(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def even_partition(num_blocks: int, parts: int) -> list[range]:
    """Contiguous ranges whose sizes differ by at most one, the larger ones first."""
    if parts > num_blocks:
        return partition([1] * num_blocks, parts)  # raises the error that explains
    base, extra = divmod(num_blocks, parts)
    sizes = [base + (1 if p < extra else 0) for p in range(parts)]
    starts = [sum(sizes[:p]) for p in range(parts)]
    return [range(start, start + size) for start, size in zip(starts, sizes, strict=True)]


def partition(
    weights: list[int], parts: int, first_extra: int = 0, last_extra: int = 0
) -> list[range]:
    """Split blocks 0..n-1 into `parts` contiguous non-empty ranges minimising the heaviest.

    The first part also carries `first_extra` (embeddings), the last `last_extra` (head).
    Dynamic programme over (blocks used, parts used): O(n^2 * parts), trivial at our sizes.
    """
    n = len(weights)
    if parts > n:
        raise ValueError(
            f"{n} blocks cannot be split into {parts} pipeline pieces (stages x chunks); "
            f"each piece needs at least one block: use at most {n} pieces"
        )
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)

    def cost(i: int, j: int, p: int) -> int:  # blocks i..j-1 as part p
        extra = (first_extra if p == 0 else 0) + (last_extra if p == parts - 1 else 0)
        return prefix[j] - prefix[i] + extra

    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]  # best[p][j]: p parts over j blocks
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for p in range(1, parts + 1):
        for j in range(p, n - (parts - p) + 1):
            for i in range(p - 1, j):
                value = max(best[p - 1][i], cost(i, j, p - 1))
                if value < best[p][j]:  # strict: ties keep earlier cuts (deterministic)
                    best[p][j], cut[p][j] = value, i
    bounds = [n]
    for p in range(parts, 0, -1):
        bounds.append(cut[p][bounds[-1]])
    bounds.reverse()
    return [range(bounds[p], bounds[p + 1]) for p in range(parts)]


def stage_layout(
    model: nn.Module,
    num_stages: int,
    chunks: int = 1,
    balance: str = "layers",
    *,
    plan: PipelinePlan,
) -> list[list[str]]:
    """Block names of each virtual stage 0 .. S*v - 1 (the same on every rank)."""
    if balance not in BALANCES:
        raise ValueError(f"balance {balance!r}; valid: {', '.join(BALANCES)}")
    blocks = getattr(model, plan.blocks)
    if not isinstance(blocks, nn.ModuleDict):
        raise ValueError(
            f"model.{plan.blocks} is a {type(blocks).__name__}; the pipeline needs an "
            "nn.ModuleDict so that parameter names keep their global block index"
        )
    names = list(blocks.keys())
    parts = num_stages * chunks
    if balance == "layers":
        pieces = even_partition(len(names), parts)
    else:
        weights = [_params(blocks[n]) for n in names]
        first = sum(_params(getattr(model, m)) for m in plan.first)
        last = sum(_params(getattr(model, m)) for m in plan.last)
        pieces = partition(weights, parts, first, last)
    return [[names[i] for i in piece] for piece in pieces]


def _check_plan(model: nn.Module, plan: PipelinePlan) -> None:
    if any(True for _ in model.named_parameters(recurse=False)):
        raise ValueError("the model has parameters of its own; put them in a submodule")
    placed = {plan.blocks, *plan.first, *plan.last}
    for name, child in model.named_children():
        if name not in placed and _params(child) > 0:
            raise ValueError(
                f"module {name!r} has parameters but the plan places it on no stage; "
                f"list it in PipelinePlan.first or .last (blocks: {plan.blocks!r})"
            )


def _make_chunk(
    model: nn.Module, keep: list[str], is_first: bool, is_last: bool, plan: PipelinePlan
) -> nn.Module:
    chunk = copy.copy(model)  # shallow: shares the kept submodules with the full model
    chunk._modules = dict(model._modules)  # own table, so dropping parts leaves model whole
    chunk._parameters = dict(model._parameters)
    chunk._buffers = dict(model._buffers)
    for name in plan.first:
        if not is_first:
            setattr(chunk, name, None)
    for name in plan.last:
        if not is_last:
            setattr(chunk, name, None)
    blocks = getattr(model, plan.blocks)
    setattr(chunk, plan.blocks, nn.ModuleDict({n: blocks[n] for n in keep}))
    return chunk


def split_into_stages(
    model: nn.Module,
    stage: int,
    num_stages: int,
    chunks: int = 1,
    balance: str = "layers",
    *,
    plan: PipelinePlan,
) -> list[nn.Module]:
    """This stage's chunks, in local chunk order (chunk c = virtual stage c * S + stage).

    `balance='layers'` gives the pieces numbers of blocks that differ by at most one
    (the larger first);
    `'params'` minimises the largest piece's parameter count,
    counting the embeddings on the first piece and the head on the last.
    """
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} outside 0..{num_stages - 1} (num_stages={num_stages})")
    if chunks < 1:
        raise ValueError(f"chunks={chunks}; valid: >= 1")
    _check_plan(model, plan)
    layout = stage_layout(model, num_stages, chunks, balance, plan=plan)
    last = num_stages * chunks - 1
    out = []
    for c in range(chunks):
        vs = c * num_stages + stage
        out.append(_make_chunk(model, layout[vs], vs == 0, vs == last, plan))
    return out
