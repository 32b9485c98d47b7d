"""One checkpoint's save planning on a simulated rank: what `paratrain train` would hand
torch.distributed.checkpoint, planned by the same planner, with nothing written.

The state is `checkpoint.save`'s (checkpoint/training_state.py `engine_state`: every
parameter's value and AdamW moments as boxes of the global tensors, the step counters,
any --compress state), and DCP's local plan is `ShardedSavePlanner`'s, the one the save
uses. Its write items are this rank's part of the checkpoint before DCP's global plan
drops the copies that other ranks also write (replicated boxes): that step needs every
rank's plan, which a one-rank simulation does not have.
"""

from __future__ import annotations

import math
from typing import Any

from torch.distributed.checkpoint.planner import SavePlan

from paratrain.checkpoint.planner import ShardedSavePlanner
from paratrain.checkpoint.training_state import engine_state
from paratrain.mesh import Mesh


def local_save_plan(engine: Any, optimizer: Any, mesh: Mesh) -> SavePlan:
    """DCP's local plan of this rank's checkpoint entries (module docstring)."""
    state = engine_state(engine, optimizer, mesh)
    planner = ShardedSavePlanner()
    planner.set_up_planner(dict(state.tensors), is_coordinator=mesh.global_rank == 0)
    return planner.create_local_plan()


def planned_tensor_bytes(plan: SavePlan) -> int:
    """The tensor bytes a plan's write items cover."""
    return sum(
        math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize
        for item in plan.items
        if item.tensor_data is not None
    )
