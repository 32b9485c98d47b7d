"""Data parallelism, first version: replicas start equal and average their gradients.

Every replica holds the whole model and a different slice of the global batch; averaging
the gradients over the dp group makes each optimizer step equal to one step on the whole
batch (seeds, definition 9.2.1). This version all-reduces one flat buffer after the
backward pass; bucketing and overlap with backward come with the data-parallel issue.
"""

from __future__ import annotations

import torch
from torch import nn

from paratrain import comm


def broadcast_parameters(model: nn.Module, group: comm.CommGroup) -> None:
    """Copy group rank 0's parameters and buffers to every replica, in one message."""
    tensors = [t.data for t in (*model.parameters(), *model.buffers())]
    if group.size == 1 or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    comm.broadcast(flat, group, src=0)
    _unflatten_into(flat, tensors)


def all_reduce_gradients(model: nn.Module, group: comm.CommGroup) -> None:
    """Average every parameter's gradient over the group.

    A parameter that got no gradient on this rank contributes zeros, so every rank sends
    the same buffer and a parameter unused in one step cannot hang the collective.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if group.size == 1 or not params:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.all_reduce(flat, group, op="avg")
    _unflatten_into(flat, grads)


def _unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
