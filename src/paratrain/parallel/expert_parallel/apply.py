"""Expert parallelism applied from outside, to MoE layers named by the caller.

    groups = expert_groups(dp, ep)                        # groups.py: which ranks share what
    apply_expert_parallel(model, ["blocks.0.mlp"], ep_group, dp_group)

Each named layer must have the two seams of models/moe.py: `experts`, called as
experts(tokens grouped by expert, counts per expert), parameters stacked along dimension
0; and `batch`, its view of the batch. The first becomes an ExpertParallel around this
rank's slice of the experts (module names gain `.local`), the second a GroupBatch over
the data-parallel group, so capacity and statistics stay those of the whole batch.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, cast

from torch import nn

from paratrain.comm.group import CommGroup
from paratrain.parallel.expert_parallel.batch import GroupBatch
from paratrain.parallel.expert_parallel.dispatch import ExpertParallel, shard_experts


class _Seams(Protocol):
    """A MoE layer's two seams (module docstring), as this module reads and sets them."""

    experts: nn.Module
    batch: object


def apply_expert_parallel(
    model: nn.Module,
    layers: Iterable[str],
    ep_group: CommGroup,
    batch_group: CommGroup,
    algo: str | None = None,
) -> nn.Module:
    """Split the experts of each named layer ("" names the model itself) over ep_group.

    The model must hold every expert (built full, same seed on every rank): each rank
    keeps its own slice. `algo` chooses the all-to-all algorithm (comm.all_to_all).
    """
    for name in layers:
        layer = cast(_Seams, model.get_submodule(name))  # the seams: read, set below
        experts = layer.experts
        if isinstance(experts, ExpertParallel):
            raise ValueError(f"layer {name!r}: its experts are split already")
        num_experts = next(experts.parameters()).shape[0]
        local = shard_experts(experts, ep_group.rank, ep_group.size)
        layer.experts = ExpertParallel(local, num_experts, ep_group, algo)
        layer.batch = GroupBatch(batch_group)
    return model
