"""`--ranks roles`: one rank of each kind, so that a few simulated ranks cover them all.

Two sources of kinds:
- the mesh (`mesh_roles`): each pipeline stage (its layers, chunks and ends) by the first
  and last tp coordinate (the vocabulary's split) and by the first and last rank of the
  dp_cp group, dp and cp both first or both last. The last holds the padded end of every
  shard: ZeRO's over dp_cp or over a replica group, and the experts' over expert_dp; as
  ep runs are consecutive in dp_cp, the first and last are also the first and last place
  in an ep run;
- the shards (`shard_roles`): ZeRO cuts each flat buffer into k shards of ceil(n / k), so
  a rank in the middle can hold the partial shard of one buffer and nothing of the
  next: its model state or its checkpoint's part differs from both ends'. The planner
  tells them apart (plan/rank_memory.py, plan/rank_checkpoint.py): the first rank of each
  stage with its own (state, checkpoint bytes) joins the roles.
The cp coordinates in between hold load-balanced chunks of the same size: no kind of
their own.
"""

from __future__ import annotations

from paratrain.config import RunConfig
from paratrain.mesh import MeshShape
from paratrain.plan.rank_checkpoint import checkpoint_bytes
from paratrain.plan.rank_groups import Coords
from paratrain.plan.run_inputs import planner_inputs
from paratrain.train.prediction import STATE_KINDS, predict


def mesh_shape(cfg: RunConfig) -> MeshShape:
    p = cfg.parallel
    return MeshShape(dp=p.dp, pp=p.pp, tp=p.tp, cp=p.cp, ep=p.ep, replicas=p.replicas)


def mesh_roles(shape: MeshShape) -> list[int]:
    """One rank per kind the mesh distinguishes (module docstring), in rank order."""
    chosen = set()
    for stage in range(shape.pp):
        for dp, cp in {(0, 0), (shape.dp - 1, shape.cp - 1)}:  # dp_cp's first and last
            for tp in {0, shape.tp - 1}:
                chosen.add(shape.rank_at({"pp": stage, "dp": dp, "cp": cp, "tp": tp}))
    return sorted(chosen)


def shard_roles(cfg: RunConfig) -> list[int]:
    """The first rank of each stage and tp coordinate 0 with its own model state and
    checkpoint part, by the planner's count (module docstring)."""
    shape, every = mesh_shape(cfg), predict(cfg)
    model, workload, layout, _ = planner_inputs(cfg)
    seen: dict[tuple, int] = {}
    for rank in range(shape.world_size):
        c = shape.coords(rank)
        if c["tp"]:
            continue
        at = Coords(stage=c["pp"], dp_rank=c["dp"], tp_rank=0, cp_rank=c["cp"])
        state = tuple(every.model_state[rank][k] for k in STATE_KINDS)
        saved = checkpoint_bytes(model, workload, layout, at)
        seen.setdefault((c["pp"], state, saved), rank)
    return sorted(seen.values())


def roles(cfg: RunConfig) -> list[int]:
    """`--ranks roles`: the mesh's kinds and the shards'."""
    return sorted({*mesh_roles(mesh_shape(cfg)), *shard_roles(cfg)})
