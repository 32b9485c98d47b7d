"""The PyTorch-native peers of `paratrain bench zero`, and their model-state bytes.

- ZeRO-1 and ZeRO-2 against `DistributedDataParallel(gradient_as_bucket_view=True)` with
  `ZeroRedundancyOptimizer(optimizer_class=AdamW)`: its documented configuration (DDP
  all-reduces full gradients; each rank keeps the AdamW state of a greedy, parameter-whole
  partition and broadcasts its updated parameters). torch has no ZeRO-2 in this family,
  so our stage 2 meets the same peer: it shows what sharding the gradients saves.
- ZeRO-3 against FSDP2: `fully_shard` on each block, then on the root (embeddings, final
  norm, head), over a 1-D CPU device mesh with gloo; AdamW(foreach=True) on the DTensor
  parameters. `reshard_after_forward` is left at its default (True).

Bytes are counted as ours are (`parallel/zero_optim.py: memory_report`): each storage
reachable on the rank once, by kind, at the step boundary. The peer's parameters and
gradients are the local pieces of its DTensors (FSDP2 pads each parameter's shard, so a
parameter's storage counts its padding); any gathered parameter FSDP2 still holds (none
once a step has ended) counts as `other`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paratrain.train.optim import build_adamw, param_groups

KINDS = ("params", "grads", "master", "optimizer", "padding", "other")


def wrap_ddp_zero(
    module: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float]
) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(module, gradient_as_bucket_view=True)
    opt = ZeroRedundancyOptimizer(
        param_groups(module, weight_decay),
        optimizer_class=torch.optim.AdamW,
        lr=lr,
        betas=betas,
        foreach=True,
    )
    return model, opt


def wrap_fsdp2(
    module: nn.Module, world: int, lr: float, weight_decay: float, betas: tuple[float, float]
) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for block in module.blocks.values():
        fully_shard(block, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return module, build_adamw(module, lr, weight_decay, betas)


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _fsdp2_gathered(module: nn.Module) -> list[torch.Tensor]:
    """Gathered parameters FSDP2 still holds (private attributes; empty if they moved)."""
    out = []
    for m in module.modules():
        state = getattr(m, "_get_fsdp_state", None)
        groups = getattr(state(), "_fsdp_param_groups", []) if state else []
        for group in groups:
            for fp in group.fsdp_params:
                out += list(getattr(fp, "all_gather_outputs", []))
                unsharded = getattr(fp, "_unsharded_param", None)
                if unsharded is not None:
                    out.append(unsharded)
    return out


def peer_state_bytes(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of unique storage held by the peer on this rank, by kind (KINDS)."""
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's local AdamW
    seen: set[int] = set()
    totals = dict.fromkeys(KINDS, 0)

    def add(kind: str, t: Any) -> None:
        t = _local(t)
        if not isinstance(t, torch.Tensor):
            return
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            return
        seen.add(storage.data_ptr())
        totals[kind] += storage.nbytes()

    for p in module.parameters():
        add("params", p)
    for p in module.parameters():
        add("grads", p.grad)
    for state in inner.state.values():
        for key, value in state.items():
            add("optimizer" if key in ("exp_avg", "exp_avg_sq") else "other", value)
    for t in _fsdp2_gathered(module):
        add("other", t)
    for b in module.buffers():
        add("other", b)
    return totals
