"""The PyTorch-native peers of `paratrain bench zero`, their model-state bytes and traffic.

One peer per ZeRO stage, on the same GPT, AdamW(foreach=True), decay on matrices only:
- stage 0: `DistributedDataParallel(gradient_as_bucket_view=True)`, its documented fast
  configuration (gradients all-reduced in buckets during backward).
- stage 1: the same DDP with `ZeroRedundancyOptimizer(optimizer_class=AdamW)`: each rank
  keeps the AdamW state of a greedy, parameter-whole partition and broadcasts its updated
  parameters after the step.
- stage 2: FSDP2 `fully_shard(reshard_after_forward=False)` on each block, then on the
  root: parameters stay gathered from forward to backward (one all-gather per step, like
  ZeRO-2's), gradients are reduce-scattered. Unlike ZeRO-2 it reshards the parameters
  after backward, so at the step boundary it holds 16N/k, not 4N + 12N/k.
- stage 3: FSDP2 `fully_shard` on each block, then on the root, with the default
  resharding (blocks re-gathered in backward; the root, by FSDP2's rule, is not).
FSDP2 runs over a 1-D CPU device mesh with gloo.

Bytes held are counted as ours are (`parallel/zero_optim.py: memory_report`): each
storage reachable on the rank once, by kind, at the step boundary. The peer's parameters
and gradients are the local pieces of its DTensors (FSDP2 pads each parameter's shard,
so a storage counts its padding); a gathered parameter FSDP2 still holds counts as
`params`; AdamW's step counters and module buffers are `other`, outside the model state.

Bytes sent are counted at the dispatcher (bench/harness/peer_traffic.py): DDP's reducer,
the ZeRO optimizer and FSDP2 issue `c10d` ops, and FSDP2's gradient norm a functional
all-reduce (DTensor's `full_tensor`), all sized and put through the same ring and chain
formulas our ledger uses for native collectives (`comm/traffic.py`). Our ledger itself
never sees them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import nn

from paratrain.parallel.data_parallel.adamw import adamw, param_groups
from paratrain.parallel.data_parallel.memory_count import count_memory

KINDS = ("params", "grads", "master", "optimizer", "padding", "other")
STATE_KINDS = KINDS[:-1]  # model state: everything but step counters and buffers
DDP = "DistributedDataParallel(gradient_as_bucket_view=True) + AdamW(foreach=True)"
PEERS = {
    0: DDP,
    1: "DistributedDataParallel(gradient_as_bucket_view=True) + "
    "ZeroRedundancyOptimizer(optimizer_class=AdamW, foreach=True)",
    2: "FSDP2 fully_shard(reshard_after_forward=False) per block, then the root; "
    "AdamW(foreach=True)",
    3: "FSDP2 fully_shard per block, then the root (default resharding); AdamW(foreach=True)",
    "hsdp": "FSDP2 fully_shard per block, then the root, on a 2-D device mesh (replicate, "
    "shard): HSDP; AdamW(foreach=True)",
}


def wrap_peer(
    zero: int,
    module: nn.Module,
    world: int,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    replicas: int = 1,
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The peer of ZeRO stage `zero` (PEERS) around `module`, and its optimizer; with
    `replicas` > 1 (stage 3) FSDP2's HSDP over that many replica groups."""
    from torch.nn.parallel import DistributedDataParallel

    if zero >= 2:
        sharded = _fully_shard(module, world, zero == 3, replicas)
        return sharded, adamw(module, lr, weight_decay, betas)
    model = DistributedDataParallel(module, gradient_as_bucket_view=True)
    if zero == 0:
        return model, adamw(module, lr, weight_decay, betas)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    opt = ZeroRedundancyOptimizer(
        param_groups(module, weight_decay),
        optimizer_class=torch.optim.AdamW,
        lr=lr,
        betas=betas,
        foreach=True,
    )
    return model, opt


def _fully_shard(module: nn.Module, world: int, reshard: bool, replicas: int = 1) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if replicas > 1:  # HSDP: a 2-D mesh, replicas outer and shards inner, as ours (mesh.py)
        shape, names = (replicas, world // replicas), ("replicate", "shard")
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    else:
        mesh = init_device_mesh("cpu", (world,))
    # The default reshards every unit but the root.
    kwargs: dict[str, Any] = {} if reshard else {"reshard_after_forward": False}
    for block in cast(nn.ModuleDict, module.blocks).values():
        fully_shard(block, mesh=mesh, **kwargs)
    fully_shard(module, mesh=mesh, **kwargs)
    return module


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


def state_bytes(
    module: nn.Module, optimizer: Any, grad_buffers: Sequence[torch.Tensor] = ()
) -> dict[str, int]:
    """Bytes of unique storage held on this rank, by kind (KINDS).

    For every peer, and for our stage 0 (plain `DataParallel`, whose `grad_buffers` are
    its buckets), so both sides of that comparison are counted by the same code.
    """
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's local AdamW
    params = list(module.parameters())
    known = [("params", _local(p)) for p in params]
    known += [("params", t) for t in _fsdp2_gathered(module)]
    known += [("grads", t) for t in grad_buffers]
    known += [("grads", _local(p.grad)) for p in params if p.grad is not None]
    known += [("other", _local(b)) for b in module.buffers()]
    states = [{k: _local(v) for k, v in state.items()} for state in inner.state.values()]
    report = count_memory(known, {}, None, states).as_dict()  # counted as ours are
    report.pop("total")
    return report
