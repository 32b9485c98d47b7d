"""What a checkpoint stores of a training run, by key (checkpoint/state.py's boxes).

Every mode stores `rank_state`. Under DiLoCo (--dp-mode diloco, parallel/diloco.py) a
checkpoint is taken at an outer step, when every replica group holds the global
parameters, so `model.<name>` is saved once, as ever; the outer momentum, the same in
every group, once too (`outer.velocity.<name>`); but each group's inner optimizer state is
its own, so its keys carry the group, `group<g>.optim.<moment>.<name>` (every rank lists
every group's keys, the other groups' with no boxes, so that all ranks' key sets agree).
A run resumes with the same number of groups, each on any inner layout.
"""

from __future__ import annotations

from typing import Any

from paratrain.checkpoint.state import RankState, Sharded, rank_state
from paratrain.mesh import Mesh

OPTIM = "optim."


def engine_state(engine: Any, optimizer: Any, mesh: Mesh) -> RankState:
    """This rank's `rank_state`, under DiLoCo (`optimizer.outer`) with the outer momentum
    and its group's optimizer state under the group's keys (`under_group_keys`)."""
    outer = optimizer.outer
    velocity = outer.velocity if outer is not None and outer.settings.momentum else None
    state = rank_state(engine.replicas, optimizer.optimizers, engine.tp, velocity)
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
