"""What a checkpoint stores of a training run, by key (checkpoint/state.py's boxes).

Every mode stores `rank_state`. Under DiLoCo (--dp-mode diloco, parallel/diloco.py) a
checkpoint is taken at an outer step, when every replica group holds the global
parameters, so `model.<name>` is saved once, as ever; the outer momentum, the same in
every group, once too (`outer.velocity.<name>`); but each group's inner optimizer state is
its own, so its keys carry the group, `group<g>.optim.<moment>.<name>` (every rank lists
every group's keys, the other groups' with no boxes, so that all ranks' key sets agree).
A run resumes with the same number of groups, each on any inner layout.

Under --compress (parallel/data_parallel/compression.py) each rank's error buffers and
PowerSGD factors are its own: saved under its global rank and its wrappers' order,
`compress.rank<r>.<i>.<name>`, and loaded only on the same layout with the same method and
rank (checkpoint/load.py); elsewhere they start again from zero, and the resume says so.
"""

from __future__ import annotations

from typing import Any

from paratrain.checkpoint.state import Box, RankState, Sharded, rank_state
from paratrain.config import RunConfig
from paratrain.mesh import Mesh

OPTIM = "optim."
COMPRESS = "compress."


def engine_state(engine: Any, optimizer: Any, mesh: Mesh) -> RankState:
    """This rank's `rank_state`, under DiLoCo (`optimizer.outer`) with the outer momentum
    and its group's optimizer state under the group's keys (`under_group_keys`)."""
    outer = optimizer.outer
    velocity = outer.velocity if outer is not None and outer.settings.momentum else None
    state = rank_state(engine.replicas, optimizer.optimizers, engine.tp, velocity)
    state.tensors.update(compression_state(engine.replicas, mesh.global_rank))
    if outer is None:
        return state
    return under_group_keys(state, mesh.coord("dp_replicate"), mesh.size("dp_replicate"))


def under_group_keys(state: RankState, group: int, groups: int) -> RankState:
    """`state` with every `optim.` key moved under `group<group>.`, and the same keys of
    the other groups present with no boxes."""
    tensors: dict[str, Sharded] = {}
    for key, sharded in state.tensors.items():
        if not key.startswith(OPTIM):
            tensors[key] = sharded
            continue
        for g in range(groups):
            tensors[f"group{g}.{key}"] = sharded if g == group else Sharded(sharded.shape, [])
    return RankState(tensors, state.step_counters)


def compression_state(replicas: list[Any], rank: int) -> dict[str, Sharded]:
    """This rank's --compress state, whole, under its own keys (the module docstring)."""
    out: dict[str, Sharded] = {}
    for i, replica in enumerate(replicas):
        compressor = getattr(replica, "compressor", None)
        if compressor is None:
            continue
        for name, t in compressor.state_tensors().items():
            box = Box((0,) * t.dim(), t)
            out[f"{COMPRESS}rank{rank}.{i}.{name}"] = Sharded(t.shape, [box])
    return out


def diloco_meta(cfg: RunConfig) -> dict[str, Any]:
    """Under DiLoCo, what a resumed run must keep: its groups (each has its own optimizer
    state) and whether the outer step has momentum (then its state is saved)."""
    p = cfg.parallel
    if p.dp_mode != "diloco":
        return {}
    return {"diloco": {"replicas": p.replicas, "outer_momentum": p.outer_momentum > 0}}


def compress_meta(cfg: RunConfig) -> dict[str, Any]:
    """Under --compress, what its saved state belongs to: the method, and PowerSGD's rank."""
    p = cfg.parallel
    if p.compress == "none":
        return {}
    rank = p.compress_rank if p.compress == "powersgd" else None
    return {"compress": {"method": p.compress, "rank": rank}}
