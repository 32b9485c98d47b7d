"""Gradient clipping by the global norm over every parameter of the model, counted once.

The norm must be global: clipping each stage (or shard) by its own norm would scale the
parts differently and change the update's direction. Each rank sums the squares of its own
gradients: the squares of tensor-parallel shards are summed over the tp group, while a
parameter replicated on every tp rank (LayerNorm) counts once; pipeline stages hold
different parameters, so their sums add over the pp group. Data-parallel replicas hold
identical, already reduced gradients: they add nothing.
"""

from __future__ import annotations

import torch
from torch import nn

from paratrain import comm
from paratrain.parallel.tensor_parallel_state import sharded_parameters


def global_grad_norm(
    modules: list[nn.Module],
    tp: comm.CommGroup | None = None,
    pp: comm.CommGroup | None = None,
) -> float:
    split = {id(p) for m in modules for p, _ in sharded_parameters(m).values()}
    grads: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])  # (tp-split, replicated)
    for m in modules:
        for p in m.parameters():
            if p.grad is not None:
                grads[0 if id(p) in split else 1].append(p.grad.detach())
    squares = torch.zeros(2, dtype=torch.float64)  # (tp-split, replicated) on this rank
    for i, group in enumerate(grads):
        if group:  # one fused kernel per list, as torch.nn.utils.clip_grad_norm_ does
            squares[i] = torch.stack(torch._foreach_norm(group)).double().pow(2).sum()
    if tp is not None and tp.size > 1:
        comm.all_reduce(squares[:1], tp, op="sum")
    total = squares.sum().reshape(1)
    if pp is not None and pp.size > 1:
        comm.all_reduce(total, pp, op="sum")
    return float(total.sqrt())


def clip_global_norm(
    modules: list[nn.Module],
    max_norm: float,
    tp: comm.CommGroup | None = None,
    pp: comm.CommGroup | None = None,
) -> float:
    """Return the global L2 norm before clipping; scale gradients if it exceeds max_norm.

    The same rule as torch.nn.utils.clip_grad_norm_: scale by max_norm / (norm + 1e-6).
    """
    total = global_grad_norm(modules, tp, pp)
    if max_norm > 0 and total > max_norm:
        grads = [p.grad for m in modules for p in m.parameters() if p.grad is not None]
        torch._foreach_mul_(grads, max_norm / (total + 1e-6))
    return total
