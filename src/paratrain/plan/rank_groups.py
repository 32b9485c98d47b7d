"""Where a rank sits in the runtime's groups, and the labelled bytes it sends on them.

The comm ledger counts bytes per group name (mesh.py). A derived group as large as the
one it refines is that group, under that name: with cp 1 the gradient group dp_cp is
"dp", with ep 1 the experts' group expert_dp is the gradient group. `group_name` follows
the same rule, so a predicted term lands where the ledger puts the measured one.

Inside dp_cp the ranks are in rank order, dp-major and cp-minor; an ep group is a run of
ep consecutive ones, an expert_dp group the ranks at the same place in every run
(mesh.py `_derived_groups`). Under HSDP a replica group ("dp_shard") is a run of
dp_cp / R consecutive ones, "dp_replicate" the ranks at the same place in every run, and
"expert_shard" the ranks of one replica group at the same place in their ep runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.plan.layout import Layout

# Every group the ledger names (mesh.py GROUPS less "world" and "control"), in the order
# the prediction reports them.
AXES = ("dp", "dp_cp", "dp_shard", "dp_replicate", "cp", "tp", "pp", "ep", "expert_dp",
        "expert_shard")  # fmt: skip


@dataclass(frozen=True)
class Coords:
    """A rank's place in the mesh (mesh.py): pipeline stage, dp replica, tp and cp rank."""

    stage: int = 0
    dp_rank: int = 0
    tp_rank: int = 0
    cp_rank: int = 0


@dataclass(frozen=True)
class RankTraffic:
    axis: str  # the ledger's group name (`group_name`)
    op: str
    what: str
    bytes: int  # sent by this rank per optimizer step
    bookkeeping: bool = False  # a runtime scalar that `estimate` leaves out
    routed: bool = False  # depends on the router's choices: predicted for a balanced one


def group_name(kind: str, layout: Layout) -> str:
    """The ledger's name for a group of `kind` (an axis or a derived group, mesh.py)."""
    if kind == "dp_cp":
        return "dp" if layout.cp == 1 else "dp_cp"
    if kind == "expert_dp":
        return group_name("dp_cp", layout) if layout.ep == 1 else "expert_dp"
    if kind == "dp_shard":  # HSDP's replica group (mesh.py); without replicas, dp_cp
        return group_name("dp_cp", layout) if layout.replicas == 1 else "dp_shard"
    if kind == "expert_shard":  # HSDP's experts' shard group: expert_dp, or dp_shard
        if layout.ep == 1:
            return group_name("dp_shard", layout)
        return group_name("expert_dp", layout) if layout.replicas == 1 else "expert_shard"
    return kind


def data_rank(layout: Layout, at: Coords) -> int:
    """The rank's place in its dp_cp group (the gradient group): dp-major, cp-minor."""
    return at.dp_rank * layout.cp + at.cp_rank


def shard_rank(layout: Layout, at: Coords) -> int:
    """The rank's place in its HSDP replica group (a run of consecutive dp_cp ranks)."""
    return data_rank(layout, at) % layout.shard_ranks


def replica_rank(layout: Layout, at: Coords) -> int:
    """Which HSDP replica group the rank is in: its place in its dp_replicate group."""
    return data_rank(layout, at) // layout.shard_ranks


def ep_rank(layout: Layout, at: Coords) -> int:
    return data_rank(layout, at) % layout.ep


def expert_dp_rank(layout: Layout, at: Coords) -> int:
    return data_rank(layout, at) // layout.ep


def expert_shard_rank(layout: Layout, at: Coords) -> int:
    """The rank's place among the ranks of its replica group holding its experts."""
    return shard_rank(layout, at) // layout.ep
