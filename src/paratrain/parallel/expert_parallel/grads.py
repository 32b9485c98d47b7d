"""Gradient reduction under expert parallelism, and why the expert factor is not 1/replicas.

Data parallelism over R ranks trains on the mean of the shards' losses, L = (1/R) Σ_r L_r:
each rank differentiates its own L_r, and averaging over the R ranks gives ∇L. That holds
for the router and shared parameters, which every rank holds: average over dp (R ranks).

An expert's parameters live on one rank of each ep group. Through the all-to-all's
backward, the gradient there is already the sum over the ep group's ep shards,
Σ_{r in ep group} ∇L_r. Summing that over the expert-dp group (the R/ep ranks holding the
same experts) gives Σ_r ∇L_r over all R shards, so the factor is 1/R, the data-parallel
degree, not 1/(R/ep), the size of the group the reduction runs on: averaging over the
expert-dp group would scale expert gradients by ep (Megatron-Core scales them by 1/ep for
this reason). The mistake is invisible when the expert-dp group has one rank and ep = R;
tests/test_expert_parallel.py checks dp 4 x ep 2, where it is not.
"""

from __future__ import annotations

import torch
from torch import nn

from paratrain import comm
from paratrain.comm.group import CommGroup
from paratrain.parallel.expert_parallel.dispatch import expert_parameters


def reduce_gradients(model: nn.Module, dp_group: CommGroup, expert_dp_group: CommGroup) -> None:
    """In place: the gradients of split experts summed over their expert-dp group and
    divided by the dp degree (module docstring); every other gradient averaged over dp.
    A parameter that got no gradient (an expert no token reached) counts as zero."""
    experts = expert_parameters(model)
    dense = [p for p in model.parameters() if all(p is not q for q in experts)]
    for p in dense:
        comm.all_reduce(_grad(p), dp_group, op="avg")
    for p in experts:
        comm.all_reduce(_grad(p), expert_dp_group, op="sum").div_(dp_group.size)


def _grad(p: nn.Parameter) -> torch.Tensor:
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad
