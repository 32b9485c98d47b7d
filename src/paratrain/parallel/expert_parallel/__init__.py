"""Expert parallelism: the experts of each MoE layer split over an ep group of ranks.

The model is plain (models/moe.py); this package changes it from outside and never imports
it (docs/experts.md):

    groups.py    which ranks split experts, which hold the same ones (pure arithmetic)
    dispatch.py  the differentiable all-to-all, ExpertParallel: counts, tokens, combine
    batch.py     GroupBatch: every shard's routing counts, for capacity and statistics
    apply.py     apply_expert_parallel on named layers
    grads.py     gradient reduction: dense over dp, experts over the expert-dp group

Its costs as formulas (the all-to-all bytes per rank) are the planner's:
plan/expert_cost.py. Every function takes its group explicitly; all traffic goes through comm.
"""

from paratrain.parallel.expert_parallel.apply import apply_expert_parallel
from paratrain.parallel.expert_parallel.batch import GroupBatch
from paratrain.parallel.expert_parallel.dispatch import (
    ExpertParallel,
    all_to_all_rows,
    expert_parameters,
    expert_placements,
    shard_experts,
    whole_experts,
)
from paratrain.parallel.expert_parallel.grads import reduce_gradients
from paratrain.parallel.expert_parallel.groups import ExpertGroups, expert_groups, expert_range

__all__ = [
    "ExpertGroups",
    "ExpertParallel",
    "GroupBatch",
    "all_to_all_rows",
    "apply_expert_parallel",
    "expert_groups",
    "expert_parameters",
    "expert_placements",
    "expert_range",
    "reduce_gradients",
    "shard_experts",
    "whole_experts",
]
