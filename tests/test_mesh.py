"""The rank grid: coordinates (pure arithmetic) and the process groups built from them."""

from __future__ import annotations

import pytest

from paratrain.mesh import Mesh, MeshShape
from tests.distributed import run_distributed

SHAPES_OF_8 = [(8, 1, 1), (1, 8, 1), (1, 1, 8), (2, 2, 2), (4, 1, 2), (2, 4, 1), (1, 2, 4)]


def test_tensor_parallel_ranks_are_adjacent():
    shape = MeshShape(dp=2, pp=2, tp=2)
    assert shape.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert shape.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert shape.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert shape.coords(5) == {"pp": 1, "dp": 0, "cp": 0, "tp": 1}


def test_context_parallel_sits_between_data_and_tensor_parallel():
    shape = MeshShape(dp=2, cp=2, tp=2)  # arange(8).view(pp 1, dp 2, cp 2, tp 2)
    assert shape.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert shape.groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert shape.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert shape.coords(6) == {"pp": 0, "dp": 1, "cp": 1, "tp": 0}
    # Gradients are reduced over every rank holding the same parameters: dp and cp.
    assert shape.groups("dp_cp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert shape.size("dp_cp") == 4


def test_expert_groups_are_carved_out_of_the_token_holding_ranks():
    shape = MeshShape(dp=4, pp=2, ep=2)  # the dp 4 x ep 2, on two stages
    assert shape.groups("dp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert shape.groups("ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert shape.groups("expert_dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert (shape.size("ep"), shape.size("expert_dp")) == (2, 2)
    with_cp = MeshShape(dp=2, cp=2, ep=4)  # ep may span the context-parallel ranks too
    assert with_cp.groups("ep") == [[0, 1, 2, 3]]
    assert with_cp.groups("expert_dp") == [[0], [1], [2], [3]]
    for kind in ("dp_cp", "ep", "expert_dp"):  # every derived kind partitions the world
        assert sorted(r for g in MeshShape(dp=4, cp=2, ep=2).groups(kind) for r in g) == list(
            range(8)
        )


@pytest.mark.parametrize("dp, pp, tp", SHAPES_OF_8)
def test_groups_partition_the_world(dp, pp, tp):
    shape = MeshShape(dp=dp, pp=pp, tp=tp)
    for axis in ("dp", "pp", "tp"):
        groups = shape.groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(8))
        assert all(len(g) == shape.size(axis) for g in groups)
        for g in groups:  # members differ only along this axis, in coordinate order
            coords = [shape.coords(r) for r in g]
            assert [c[axis] for c in coords] == list(range(len(g)))
            others = {tuple(v for a, v in c.items() if a != axis) for c in coords}
            assert len(others) == 1
    for rank in range(8):
        assert shape.rank_at(shape.coords(rank)) == rank


def test_bad_shapes_are_refused_with_the_numbers():
    with pytest.raises(ValueError, match="at least 1"):
        MeshShape(dp=0)
    with pytest.raises(ValueError, match="unknown mesh axis 'sp'"):
        MeshShape().size("sp")
    with pytest.raises(ValueError, match=r"ep=3 must divide dp·cp = 4"):
        MeshShape(dp=2, cp=2, ep=3)


def _mesh_facts(rank, world_size, dp, pp, tp, cp=1, ep=1):
    mesh = Mesh.build(dp=dp, pp=pp, tp=tp, cp=cp, ep=ep)
    facts = {}
    for axis in ("dp", "pp", "tp", "cp", "dp_cp", "ep", "expert_dp"):
        group = mesh.group(axis)
        facts[axis] = (mesh.coord(axis), group.rank, group.size, group.ranks)
    return facts


@pytest.mark.parametrize(
    "dp, pp, tp, cp, ep", [(2, 2, 2, 1, 1), (1, 2, 2, 2, 1), (4, 2, 1, 1, 2), (2, 1, 1, 4, 4)]
)
def test_mesh_groups_on_8_ranks(dp, pp, tp, cp, ep):
    shape = MeshShape(dp=dp, pp=pp, tp=tp, cp=cp, ep=ep)
    facts = run_distributed(_mesh_facts, 8, dp, pp, tp, cp, ep)
    for rank, rank_facts in enumerate(facts):
        for axis, (coord, group_rank, size, ranks) in rank_facts.items():
            ranks_of_axis = shape.group_of(axis, rank)
            assert coord == group_rank == ranks_of_axis.index(rank)
            if axis in shape.coords(rank):
                assert coord == shape.coords(rank)[axis]
            assert size == shape.size(axis)
            assert ranks == ranks_of_axis


def _mesh_mismatch(rank, world_size):
    Mesh.build(dp=3)


def test_mesh_that_does_not_match_the_world_is_refused():
    with pytest.raises(AssertionError, match="does not match the world size 2"):
        run_distributed(_mesh_mismatch, 2)


def test_hsdp_replica_groups_are_consecutive_and_replicate_across_them():
    """HSDP (FSDP2's 2-D mesh, torchtitan's layout): a replica group is a run of
    consecutive dp ranks (one node), the ranks at one position of every run replicate."""
    shape = MeshShape(dp=4, replicas=2)
    assert shape.groups("dp_shard") == [[0, 1], [2, 3]]
    assert shape.groups("dp_replicate") == [[0, 2], [1, 3]]
    with_tp = MeshShape(dp=4, tp=2, replicas=2)  # one set per tp rank, inside its dp group
    assert with_tp.groups("dp_shard") == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert with_tp.groups("dp_replicate") == [[0, 4], [2, 6], [1, 5], [3, 7]]
    plain = MeshShape(dp=4)  # one replica group: the dp group itself, nothing to replicate
    assert plain.groups("dp_shard") == [[0, 1, 2, 3]]
    assert plain.groups("dp_replicate") == [[0], [1], [2], [3]]
    with pytest.raises(ValueError, match="replicas=3 must divide dp=4"):
        MeshShape(dp=4, replicas=3)


def test_hsdp_experts_shard_within_a_replica_group_and_replicate_across():
    """With ep > 1 each replica group holds every expert (its ep runs lie inside it): the
    experts shard over the group's ranks at one place in their runs ("expert_shard"), and
    the ranks at one place of every group hold the same expert shards (dp_replicate)."""
    shape = MeshShape(dp=8, ep=2, replicas=2)
    assert shape.groups("dp_shard") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert shape.groups("ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert shape.groups("expert_dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert shape.groups("expert_shard") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert shape.size("expert_shard") == 2
    for group in shape.groups("dp_replicate"):  # same ep place: the same experts
        assert len({shape.group_of("ep", r).index(r) for r in group}) == 1
    with pytest.raises(ValueError, match="ep=4 must divide a replica group's dp·cp / replicas"):
        MeshShape(dp=4, ep=4, replicas=2)


def _hsdp_facts(rank, world_size, dp, tp, replicas):
    mesh = Mesh.build(dp=dp, tp=tp, replicas=replicas)
    return {axis: mesh.group(axis).ranks for axis in ("dp_shard", "dp_replicate")}


def test_hsdp_groups_are_built_on_4_ranks():
    shape = MeshShape(dp=4, replicas=2)
    for rank, facts in enumerate(run_distributed(_hsdp_facts, 4, 4, 1, 2)):
        for axis, ranks in facts.items():
            assert ranks == shape.group_of(axis, rank)
