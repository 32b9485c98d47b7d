"""Which ranks share what under expert parallelism: pure arithmetic, no process group.

The ep axis is carved out of the data-parallel ranks (as in Megatron-Core and torchtitan):
the `world` data-parallel ranks each hold a shard of the batch; consecutive runs of `ep`
of them form an expert-parallel group that splits the experts between its ranks, rank i
holding experts [i·E/ep, (i+1)·E/ep). So each expert has world/ep replicas, one per ep
group, and the ranks holding the same experts (same position i in every ep group) form
the experts' own data-parallel group.

    world 4, ep 2:   ep groups [0 1] [2 3]    expert-dp groups [0 2] [1 3]    dp [0 1 2 3]

Gradients are reduced over the group whose ranks hold the same values: the router and
shared parameters over all of dp, the expert parameters over their expert-dp group
(grads.py says by what factor).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertGroups:
    ep: list[list[int]]  # ranks that split the experts between them
    expert_dp: list[list[int]]  # ranks that hold the same experts
    dp: list[int]  # every rank holding a shard of the batch

    def ep_of(self, rank: int) -> list[int]:
        return next(g for g in self.ep if rank in g)

    def expert_dp_of(self, rank: int) -> list[int]:
        return next(g for g in self.expert_dp if rank in g)


def expert_groups(world: int, ep: int) -> ExpertGroups:
    """The groups of `world` data-parallel ranks with expert-parallel degree `ep`."""
    if world < 1 or ep < 1 or world % ep:
        raise ValueError(
            f"expert parallelism over {world} data-parallel ranks with ep={ep}: ep must "
            f"divide the data-parallel degree ({world} % {ep} = {world % max(ep, 1)})"
        )
    replicas = world // ep
    ep_groups = [[g * ep + i for i in range(ep)] for g in range(replicas)]
    expert_dp = [[g * ep + i for g in range(replicas)] for i in range(ep)]
    return ExpertGroups(ep_groups, expert_dp, list(range(world)))


def expert_range(num_experts: int, rank: int, ep: int) -> range:
    """The experts rank `rank` of an ep group holds."""
    if num_experts % ep:
        raise ValueError(
            f"{num_experts} experts cannot be split evenly over ep={ep} ranks: "
            f"{num_experts} % {ep} = {num_experts % ep}"
        )
    per_rank = num_experts // ep
    return range(rank * per_rank, (rank + 1) * per_rank)
