"""The MoE layer's view of the batch when its shards are spread over a group of ranks.

Rank i of `group` holds shard i of the batch (every rank the same number of tokens is not
required). `gather` hands the layer every shard's routing counts, a few integers per
expert, from which it computes capacity, each token's place in its expert's queue and the
load-balancing statistics over the whole batch (models/moe.py), exactly as one process
holding the whole batch would. The group is every rank holding a shard of the batch: the
data-parallel ranks, the ep ranks among them.
"""

from __future__ import annotations

import torch

from paratrain import comm
from paratrain.comm.group import CommGroup


class GroupBatch:
    def __init__(self, group: CommGroup) -> None:
        self.group = group
        self.shards, self.index = group.size, group.rank

    def gather(self, counts: torch.Tensor) -> torch.Tensor:
        """(shards, *counts.shape), in rank order."""
        if self.group.size == 1:
            return counts.unsqueeze(0)
        # Every shard's counts have the same shape: no size exchange needed.
        flat = comm.all_gather_flat(counts, self.group, sizes=[counts.numel()] * self.shards)
        return flat.view(self.shards, *counts.shape)

    def __repr__(self) -> str:
        return f"GroupBatch(shard {self.index} of {self.shards}, group {self.group.name})"
