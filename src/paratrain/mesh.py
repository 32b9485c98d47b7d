"""A rank's place in the grid as process groups: `Mesh` builds, for one rank, its device,
its coordinates (mesh_shape.py: `MeshShape`, the pure arithmetic of axes and derived groups)
and one `CommGroup` per axis and derived group. A Mesh is an ordinary object passed to
whatever needs it: there is no global registry of groups.

Two kinds of group: the axes' groups ("world", "pp", "dp", "tp") carry the tensors and use
the backend the process group was initialised with (NCCL for CUDA tensors, gloo on CPU);
"control", over every rank, is always gloo and carries host-side traffic: small objects
(the run directory, errors), the preemption flag, measurements, checkpoint coordination
and the parameter server's receive-from-any, which NCCL does not have.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TypedDict

import torch
import torch.distributed as dist

from paratrain.comm.group import CommGroup, CommOptions
from paratrain.comm.ledger import Ledger
from paratrain.comm.watchdog import Watchdog, default_store_or_none
from paratrain.mesh_shape import AXES, DERIVED, GROUPS, MeshShape

__all__ = ["AXES", "DERIVED", "GROUPS", "Mesh", "MeshShape"]


class _Shared(TypedDict):
    """What every group of a mesh shares: the rank's ledger, options and watchdog."""

    ledger: Ledger
    options: CommOptions
    watchdog: Watchdog | None


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
        # CommGroup's own default when None: the same options either way.
        self._common = _Shared(ledger=ledger, options=options or CommOptions(), watchdog=watchdog)
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
        replicas: int = 1,
        control_backend: str = "gloo",
    ) -> Mesh:
        """Create the groups of every axis. Every rank must call this, in the same order.

        With torch.distributed not initialised the world must be a single rank. All groups
        share this rank's ledger, the options (timeout, default algorithm, checking) and a
        watchdog that publishes the ledger for hang reports. `device`: where this rank's
        model and batches live (cuda:LOCAL_RANK with NCCL). `replicas`: HSDP's replica
        groups (module docstring). `control_backend`: gloo, or "fake" in a simulated world
        (simulate/), where no other rank exists to rendezvous.
        """
        shape = MeshShape(dp=dp, pp=pp, tp=tp, cp=cp, ep=ep, replicas=replicas)
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
        common = _Shared(ledger=ledger, options=options, watchdog=watchdog)
        groups = {"world": CommGroup.world(**common)}
        for axis in AXES:
            groups[axis] = cls._build_axis(shape, axis, rank, common)
        # A derived group as large as the one it refines is that group: same traffic, name.
        same_as = {
            "dp_cp": ("dp", shape.cp == 1),
            "expert_dp": ("dp_cp", shape.ep == 1),
            "dp_shard": ("dp_cp", shape.replicas == 1),
            "expert_shard": (
                ("dp_shard", True) if shape.ep == 1 else ("expert_dp", shape.replicas == 1)
            ),
        }
        for kind in DERIVED:
            base, alias = same_as.get(kind, ("", False))
            groups[kind] = groups[base] if alias else cls._build_axis(shape, kind, rank, common)
        groups["control"] = cls._build_control(world, rank, common, control_backend)
        _share_streams(list(groups.values()))
        return cls(shape, rank, groups, ledger, watchdog, options, torch.device(device))

    @staticmethod
    def _build_control(world: int, rank: int, common: _Shared, backend: str = "gloo") -> CommGroup:
        """The host-side group over every rank: gloo whatever the axes' backend, so in
        gloo's order even when the axes run in NCCL's (`CommOptions.order`)."""
        ranks = list(range(world))
        pg = dist.new_group(ranks, backend=backend) if world > 1 else None
        control = _Shared(**common)
        control["options"] = replace(common["options"], order="gloo")
        return CommGroup("control", pg, ranks, rank, **control)

    @staticmethod
    def _build_axis(shape: MeshShape, axis: str, rank: int, common: _Shared) -> CommGroup:
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
