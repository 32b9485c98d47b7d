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

`MeshShape` is the pure arithmetic; `Mesh` adds the rank's device and process groups. A
Mesh is an ordinary object passed to whatever needs it: there is no global registry of
groups.

Two kinds of group: the axes' groups ("world", "pp", "dp", "tp") carry the tensors and use
the backend the process group was initialised with (NCCL for CUDA tensors, gloo on CPU);
"control", over every rank, is always gloo and carries host-side traffic: small objects
(the run directory, errors), the preemption flag, measurements, checkpoint coordination
and the parameter server's receive-from-any, which NCCL does not have.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from paratrain.comm.group import CommGroup, CommOptions
from paratrain.comm.ledger import Ledger
from paratrain.comm.watchdog import Watchdog, default_store_or_none

AXES = ("pp", "dp", "cp", "tp")  # outermost to innermost
DERIVED = ("dp_cp", "ep", "expert_dp")  # groups made of the axes' ranks (module docstring)
GROUPS = AXES + DERIVED


@dataclass(frozen=True)
class MeshShape:
    dp: int = 1
    pp: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1  # carved out of dp·cp: not an axis of its own

    def __post_init__(self) -> None:
        for axis in (*AXES, "ep"):
            if getattr(self, axis) < 1:
                raise ValueError(f"mesh {self.describe()}: every degree must be at least 1")
        if (self.dp * self.cp) % self.ep:
            raise ValueError(
                f"mesh {self.describe()}: ep={self.ep} must divide dp·cp = "
                f"{self.dp * self.cp}, the ranks that hold different tokens"
            )

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    def size(self, axis: str) -> int:
        """The degree of an axis, or the size of a derived group."""
        if axis in AXES or axis == "ep":
            return getattr(self, axis)
        if axis == "dp_cp":
            return self.dp * self.cp
        if axis == "expert_dp":
            return self.dp * self.cp // self.ep
        raise ValueError(f"unknown mesh axis {axis!r}; valid: {', '.join(GROUPS)}")

    def describe(self) -> str:
        extra = "".join(f" {a}={getattr(self, a)}" for a in ("cp", "ep") if getattr(self, a) > 1)
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
            seen.setdefault(key, [None] * size)[c[axis]] = rank  # type: ignore[index]
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
            elif kind == "ep":
                groups += [ranks[i : i + self.ep] for i in range(0, len(ranks), self.ep)]
            else:  # expert_dp: the same position in every ep run
                groups += [ranks[i :: self.ep] for i in range(self.ep)]
        return groups

    def group_of(self, axis: str, global_rank: int) -> list[int]:
        return next(g for g in self.groups(axis) if global_rank in g)

    def pipeline_ends(self) -> list[list[int]]:
        """For every pipeline (same dp and tp coordinates), its first and last stage."""
        return [[g[0], g[-1]] for g in self.groups("pp") if len(g) > 1]


class Mesh:
    """One rank's view of the grid: its device, coordinates and one CommGroup per axis."""

    def __init__(
        self,
        shape: MeshShape,
        global_rank: int,
        groups: dict[str, CommGroup],
        ledger: Ledger,
        watchdog: Watchdog | None = None,
        options: CommOptions | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.shape = shape
        self.global_rank = global_rank
        self.device = device if device is not None else torch.device("cpu")
        self.ledger = ledger
        self.watchdog = watchdog
        self._groups = groups
        self._common = {"ledger": ledger, "options": options, "watchdog": watchdog}
        self._pipeline_ends: list[CommGroup | None] = []

    @classmethod
    def build(
        cls,
        dp: int = 1,
        pp: int = 1,
        tp: int = 1,
        cp: int = 1,
        ep: int = 1,
        options: CommOptions | None = None,
        ledger: Ledger | None = None,
        device: torch.device | str = "cpu",
        control_backend: str = "gloo",
    ) -> Mesh:
        """Create the groups of every axis. Every rank must call this, in the same order.

        With torch.distributed not initialised the world must be a single rank. All groups
        share this rank's ledger, the options (timeout, default algorithm, checking) and a
        watchdog that publishes the ledger for hang reports. `device`: where this rank's
        model and batches live (cuda:LOCAL_RANK with NCCL). `control_backend`: gloo, or
        "fake" in a simulated world (simulate/), where no other rank exists to rendezvous.
        """
        shape = MeshShape(dp=dp, pp=pp, tp=tp, cp=cp, ep=ep)
        ledger = ledger if ledger is not None else Ledger()
        options = options or CommOptions()
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world != shape.world_size:
            raise ValueError(
                f"mesh {shape.describe()} does not match the world size {world}; "
                f"the degrees must multiply to {world}"
            )
        rank = dist.get_rank() if dist.is_initialized() else 0
        store = default_store_or_none() if world > 1 else None
        watchdog = Watchdog(ledger, store, rank) if store is not None else None
        common = {"ledger": ledger, "options": options, "watchdog": watchdog}
        groups = {"world": CommGroup.world(**common)}
        for axis in AXES:
            groups[axis] = cls._build_axis(shape, axis, rank, common)
        # A derived group as large as the one it refines is that group: same traffic, name.
        same_as = {"dp_cp": ("dp", shape.cp == 1), "expert_dp": ("dp_cp", shape.ep == 1)}
        for kind in DERIVED:
            base, alias = same_as.get(kind, ("", False))
            groups[kind] = groups[base] if alias else cls._build_axis(shape, kind, rank, common)
        groups["control"] = cls._build_control(world, rank, common, control_backend)
        _share_streams(list(groups.values()))
        return cls(shape, rank, groups, ledger, watchdog, options, torch.device(device))

    @staticmethod
    def _build_control(world: int, rank: int, common: dict, backend: str = "gloo") -> CommGroup:
        """The host-side group over every rank: gloo whatever the axes' backend, so in
        gloo's order even when the axes run in NCCL's (`CommOptions.order`)."""
        ranks = list(range(world))
        pg = dist.new_group(ranks, backend=backend) if world > 1 else None
        options = replace(common["options"], order="gloo")
        return CommGroup("control", pg, ranks, rank, **{**common, "options": options})

    @staticmethod
    def _build_axis(shape: MeshShape, axis: str, rank: int, common: dict) -> CommGroup:
        if shape.size(axis) == shape.world_size:
            return CommGroup.world(name=axis, **common)
        mine = shape.group_of(axis, rank)
        if shape.size(axis) == 1:
            return CommGroup(axis, None, mine, rank, **common)
        # new_group is collective over the whole world: every rank creates every group
        # of the axis in the same order and keeps its own.
        for ranks in shape.groups(axis):
            pg = dist.new_group(ranks)
            if ranks == mine:
                own = CommGroup(axis, pg, ranks, rank, **common)
        return own

    def close(self) -> None:
        """Stop the watchdog; call before destroying the process group."""
        if self.watchdog is not None:
            self.watchdog.stop()

    def pipeline_ends_group(self) -> CommGroup | None:
        """The first and the last stage of this rank's pipeline, as a group ("pp_ends"),
        for weights the two share (parallel/pipeline/tied.py); None on the stages between.

        Created on first use, collectively: every rank must ask, at the same point, as for
        `build`. Only a model with tied weights across stages needs it.
        """
        if not self._pipeline_ends:  # [] until created, then [the group or None]
            own = None
            for ranks in self.shape.pipeline_ends():
                pg = dist.new_group(ranks)
                if self.global_rank in ranks:
                    own = CommGroup("pp_ends", pg, ranks, self.global_rank, **self._common)
            self._pipeline_ends.append(own)
        return self._pipeline_ends[0]

    @property
    def control(self) -> CommGroup:
        """Every rank, over gloo: host-side traffic (CPU tensors and objects) only."""
        return self._groups["control"]

    def group(self, axis: str) -> CommGroup:
        if axis not in self._groups:
            raise ValueError(f"unknown mesh axis {axis!r}; valid: {', '.join(self._groups)}")
        return self._groups[axis]

    def coord(self, axis: str) -> int:
        """This rank's coordinate on an axis, or its rank in a derived group."""
        if axis in DERIVED:
            return self.group(axis).rank
        return self.shape.coords(self.global_rank)[axis]

    def size(self, axis: str) -> int:
        return self.shape.size(axis)

    def __repr__(self) -> str:
        coords = ", ".join(f"{a}={self.coord(a)}/{self.size(a)}" for a in AXES)
        return f"Mesh(rank {self.global_rank}: {coords})"


def _share_streams(groups: list[CommGroup]) -> None:
    """Under NCCL's order, groups over one process group (an axis as large as the world is
    the world's) take their calls in turn on one set of streams, as NCCL queues a process
    group's calls on one stream per communicator; two sets would let two threads issue
    gloo collectives on one process group in different orders on different ranks."""
    owners: list[CommGroup] = []
    for group in {id(g): g for g in groups}.values():  # an alias is the same group
        if group.pg is None or group.options.order != "nccl":
            continue
        owner = next((o for o in owners if o.pg is group.pg), None)
        if owner is None:
            owners.append(group)
        elif owner is not group:
            group.share_streams(owner)
