"""The rank grid: named axes pp, dp, cp, tp mapped to coordinates and process groups.

Ranks are laid out as `arange(world).view(pp, dp, cp, tp)`: tp is innermost, so the ranks
of one tensor-parallel group are adjacent (same node, fastest links: TP talks twice per
block per pass); cp next, since ring attention passes keys and values in every layer, in
both passes (less than TP's activations, and overlapped with attention, but far more than
a step's one gradient reduction); dp next, since its gradient all-reduce is the next
heaviest traffic; pp outermost, since stages exchange only one activation per micro-batch
and tolerate slower links. This is Megatron-LM's default order (arXiv:2104.04473, section
3; Megatron-Core puts cp between dp and tp for the same reason).

Three groups are not axes but unions or subdivisions of them (docs/context-parallel.md,
docs/experts.md):
- "dp_cp": the ranks that differ only in dp and cp. They hold the same parameters and
  different tokens, so gradients are reduced over it. With cp = 1 it is the dp group.
- "ep": expert parallelism is carved out of those token-holding ranks (ep divides dp·cp):
  consecutive runs of ep ranks of a dp_cp group split the experts between them.
- "expert_dp": the ranks of a dp_cp group at the same position in their ep run. They hold
  the same experts, so expert gradients are reduced over it. With ep = 1 it is dp_cp.
- "dp_shard" (HSDP, R = `replicas`; docs/zero.md): a run of dp·cp / R consecutive ranks
  of dp_cp, one replica group (within a node, as torchtitan's 2-D mesh), which ZeRO shards
  over; "dp_replicate": the ranks at one position of every run (same shards), over which
  the reduced shards are all-reduced. With R = 1 dp_shard is dp_cp.
- "expert_shard" (HSDP with ep > 1): the ranks of one replica group at the same position
  in their ep run, which hold the same experts and shard them. An ep run lies inside a
  replica group (ep divides dp·cp / R), so every replica group holds every expert and
  the ranks at one position of every group, dp_replicate, hold the same expert shards
  too. With R = 1 it is expert_dp; with ep = 1, dp_shard.
"""

from __future__ import annotations

from dataclasses import dataclass

AXES = ("pp", "dp", "cp", "tp")  # outermost to innermost
# groups made of the axes' ranks (module docstring)
DERIVED = ("dp_cp", "ep", "expert_dp", "dp_shard", "dp_replicate", "expert_shard")
GROUPS = AXES + DERIVED


@dataclass(frozen=True)
class MeshShape:
    dp: int = 1
    pp: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1  # carved out of dp·cp: not an axis of its own
    replicas: int = 1  # HSDP replica groups, cut out of dp (module docstring)

    def __post_init__(self) -> None:
        for axis in (*AXES, "ep", "replicas"):
            if getattr(self, axis) < 1:
                raise ValueError(f"mesh {self.describe()}: every degree must be at least 1")
        if self.dp % self.replicas:
            raise ValueError(
                f"mesh {self.describe()}: replicas={self.replicas} must divide dp={self.dp}"
            )
        if (self.dp * self.cp) % self.ep:
            raise ValueError(
                f"mesh {self.describe()}: ep={self.ep} must divide dp·cp = "
                f"{self.dp * self.cp}, the ranks that hold different tokens"
            )
        if (self.dp * self.cp // self.replicas) % self.ep:
            raise ValueError(
                f"mesh {self.describe()}: ep={self.ep} must divide a replica group's "
                f"dp·cp / replicas = {self.dp * self.cp // self.replicas} ranks"
            )

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    def size(self, axis: str) -> int:
        """The degree of an axis, or the size of a derived group."""
        if axis in AXES or axis == "ep":
            degree: int = getattr(self, axis)
            return degree
        if axis == "dp_cp":
            return self.dp * self.cp
        if axis == "expert_dp":
            return self.dp * self.cp // self.ep
        if axis == "dp_shard":
            return self.dp * self.cp // self.replicas
        if axis == "dp_replicate":
            return self.replicas
        if axis == "expert_shard":
            return self.dp * self.cp // (self.replicas * self.ep)
        raise ValueError(f"unknown mesh axis {axis!r}; valid: {', '.join(GROUPS)}")

    def describe(self) -> str:
        extra = "".join(
            f" {a}={getattr(self, a)}" for a in ("cp", "ep", "replicas") if getattr(self, a) > 1
        )
        return f"dp={self.dp} pp={self.pp} tp={self.tp}{extra} (world {self.world_size})"

    def coords(self, global_rank: int) -> dict[str, int]:
        """Coordinates of a rank on each axis, e.g. {'pp': 1, 'dp': 0, 'tp': 1}."""
        if not 0 <= global_rank < self.world_size:
            raise ValueError(f"rank {global_rank} outside mesh {self.describe()}")
        coords = {}
        rest = global_rank
        for axis in reversed(AXES):
            coords[axis] = rest % self.size(axis)
            rest //= self.size(axis)
        return coords

    def rank_at(self, coords: dict[str, int]) -> int:
        rank = 0
        for axis in AXES:
            rank = rank * self.size(axis) + coords[axis]
        return rank

    def groups(self, axis: str) -> list[list[int]]:
        """All groups along an axis (ranks that differ only in that axis' coordinate), or
        all groups of a derived kind (module docstring), each in rank order."""
        if axis in DERIVED:
            return self._derived_groups(axis)
        size = self.size(axis)
        seen: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            c = self.coords(rank)
            key = tuple(c[a] for a in AXES if a != axis)
            seen.setdefault(key, [-1] * size)[c[axis]] = rank  # every slot is set
        return list(seen.values())

    def _derived_groups(self, kind: str) -> list[list[int]]:
        token_holders: dict[tuple[int, int], list[int]] = {}  # (pp, tp) -> dp·cp ranks
        for rank in range(self.world_size):
            c = self.coords(rank)
            token_holders.setdefault((c["pp"], c["tp"]), []).append(rank)
        groups = []
        for ranks in token_holders.values():  # dp-major, cp-minor: rank order
            if kind == "dp_cp":
                groups.append(ranks)
            elif kind in ("ep", "dp_shard"):  # consecutive runs
                run = self.size(kind)
                groups += [ranks[i : i + run] for i in range(0, len(ranks), run)]
            elif kind == "expert_shard":  # in each replica group, one position of ep runs
                run, ep = self.size("dp_shard"), self.ep
                for start in range(0, len(ranks), run):
                    groups += [ranks[start + i : start + run : ep] for i in range(ep)]
            else:  # expert_dp, dp_replicate: the same position in every run
                run = self.size("ep" if kind == "expert_dp" else "dp_shard")
                groups += [ranks[i::run] for i in range(run)]
        return groups

    def group_of(self, axis: str, global_rank: int) -> list[int]:
        return next(g for g in self.groups(axis) if global_rank in g)

    def pipeline_ends(self) -> list[list[int]]:
        """For every pipeline (same dp and tp coordinates), its first and last stage."""
        return [[g[0], g[-1]] for g in self.groups("pp") if len(g) > 1]
