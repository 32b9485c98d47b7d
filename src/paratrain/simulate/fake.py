"""The fake world: torch's fake process group and fake tensors, answered in one place.

Under `FakeTensorMode` a tensor has a shape, dtype and device but no values, so a value
read back on the host (`.item()`, `float(t)`: a step's loss, the gradient norm, the token
count, Adam's step count) has no answer. `SimulatedTensors` answers every such read with
1 (True for booleans): a finite norm, a step that updates, Adam's first step. What
depends on values is therefore not simulated: the fp16 loss scaler's overflow check
(refused by the command) and the router's choices under expert parallelism.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from paratrain.comm.compat import EQUAL_OP, HOST_READ_OP, FakeTensorMode, register_fake_backend


def join_fake_world(rank: int, world: int) -> None:
    """This process becomes `rank` of a world of `world` ranks, none of which exist: every
    collective completes at once and leaves its output's values undefined."""
    register_fake_backend()  # once per process, idempotent (comm/compat.py)
    # A HashStore: no other rank will connect, and the watchdog publishes into it.
    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world)


def scalar_stand_in(dtype: torch.dtype) -> bool | float | int:
    """What a fake tensor's value reads as on the host (module docstring)."""
    if dtype == torch.bool:
        return True
    return 1.0 if dtype.is_floating_point else 1


class SimulatedTensors(FakeTensorMode):
    """Fake tensors whose host-side reads get `scalar_stand_in` instead of an error."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is HOST_READ_OP:
            return scalar_stand_in(args[0].dtype)
        if func is EQUAL_OP:  # two tensors' values compared on the host
            return scalar_stand_in(torch.bool)
        return super().__torch_dispatch__(func, types, args, kwargs)
