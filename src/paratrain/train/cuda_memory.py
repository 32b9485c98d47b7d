"""What the CUDA caching allocator holds on every rank, for the run's summary.

Reported beside the runtime's own model-state accounting (train/engine.py) and the
planner's prediction: the allocator's numbers add activations, communication buffers and
the allocator's rounding, which neither of the others counts.
"""

from __future__ import annotations

import torch

from paratrain import comm
from paratrain.mesh import Mesh

KEYS = ("cuda_allocated_bytes", "cuda_max_allocated_bytes")


def cuda_memory(mesh: Mesh) -> dict[str, list[int] | None]:
    """Collective over the control group: per rank, `torch.cuda.memory_allocated` now and
    `max_memory_allocated` over the run; None for both on the CPU."""
    if mesh.device.type != "cuda":  # the same on every rank: all or none on a GPU
        return dict.fromkeys(KEYS)
    held = [torch.cuda.memory_allocated(mesh.device), torch.cuda.max_memory_allocated(mesh.device)]
    mine = torch.tensor(held, dtype=torch.int64, device="cpu")  # host-side, over control
    control = mesh.control
    every = comm.all_gather_flat(mine, control, sizes=[len(KEYS)] * control.size)
    rows = every.view(control.size, len(KEYS)).tolist()
    return {key: [row[i] for row in rows] for i, key in enumerate(KEYS)}
