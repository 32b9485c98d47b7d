"""Weights shared by the first and the last pipeline stage: tied input and output embeddings.

GPT-2 and many Llama variants use the token embedding's matrix again as the output head.
Split into stages, the embedding lives on the first stage and the head on the last, each
rank holding its own copy of the one parameter. Both copies start equal (every rank built
the same full model), each stage computes the gradient of its own use, and the two are
summed between the two stages before the update (Megatron-LM's embedding group,
arXiv:2104.04473), so both copies take the same step and stay equal. In the global
gradient norm the summed gradient counts once: on the first stage.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from paratrain.parallel.pipeline.stage import PipelinePlan


@dataclass(frozen=True)
class TiedWeights:
    """Pairs of names of one parameter: as the first stage's chunk names it, and as the
    last stage's chunk names it, in the same order on both (empty: nothing is tied)."""

    first: tuple[str, ...] = ()
    last: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.first)


def find_tied_weights(model: nn.Module, plan: PipelinePlan) -> TiedWeights:
    """Trained parameters that a module of `plan.first` and a module of `plan.last` share,
    found by identity in the full model, before the split. A frozen one (LoRA's base
    table) has no gradient to sum: its two copies stay equal as they are."""

    def named(modules: tuple[str, ...]) -> dict[int, str]:
        out: dict[int, str] = {}
        for m in modules:
            module = getattr(model, m, None)
            if module is not None:
                for n, p in module.named_parameters(prefix=m):
                    if p.requires_grad:
                        out.setdefault(id(p), n)
        return out

    first, last = named(plan.first), named(plan.last)
    shared = [key for key in first if key in last]
    return TiedWeights(tuple(first[k] for k in shared), tuple(last[k] for k in shared))
