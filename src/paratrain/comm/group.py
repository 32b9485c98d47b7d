"""A process group with a name, its member ranks and the ledger that counts its traffic."""

from __future__ import annotations

import torch.distributed as dist

from paratrain.comm.ledger import Ledger


class CommGroup:
    """`rank` is this process's rank within the group; `ranks[i]` is group rank i's global rank.

    `pg` is None for a group of one rank, where every collective is a no-op.
    """

    def __init__(
        self,
        name: str,
        pg: dist.ProcessGroup | None,
        ranks: list[int],
        global_rank: int,
        ledger: Ledger,
    ) -> None:
        if global_rank not in ranks:
            raise ValueError(f"rank {global_rank} is not in group {name} {ranks}")
        self.name = name
        self.pg = pg
        self.ranks = list(ranks)
        self.global_rank = global_rank
        self.rank = self.ranks.index(global_rank)
        self.ledger = ledger

    @classmethod
    def world(cls, ledger: Ledger, name: str = "world") -> CommGroup:
        if not dist.is_initialized():
            return cls(name, None, [0], 0, ledger)
        size = dist.get_world_size()
        pg = dist.group.WORLD if size > 1 else None
        return cls(name, pg, list(range(size)), dist.get_rank(), ledger)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def to_global(self, rank: int) -> int:
        """The one place where a rank within the group becomes a global rank."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} outside group {self.name} of size {self.size}")
        return self.ranks[rank]

    def __repr__(self) -> str:
        return f"CommGroup({self.name}, rank {self.rank}/{self.size}, ranks={self.ranks})"
