"""Token dispatch and combine: the experts of a layer split over the ranks of an ep group.

On each rank the MoE layer hands over its kept tokens grouped by expert, with counts per
expert (E,). Rank r of ep ranks holds experts [r·E/ep, (r+1)·E/ep), so the grouped tokens
are already in destination order, and

    1. counts: all-to-all of the (ep, E/ep) counts; rank r learns recv[s, e], how many
       rows source s sends for its local expert e. Both sides then know every chunk size.
    2. dispatch: all-to-all of the tokens, uneven chunks (send[p] = Σ counts of p's
       experts). They arrive by source, then expert.
    3. regroup by local expert (source order kept within an expert), run the experts,
       and put the outputs back in arrival order.
    4. combine: the reverse all-to-all; every row returns to the rank and place it left.

Steps 2 and 4 are differentiable: the gradient of an all-to-all is the all-to-all of the
gradient with the chunk sizes swapped (chunk p of rank r's input became chunk r of rank
p's output), so backward is one combine-sized and one dispatch-sized exchange.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from paratrain import comm
from paratrain.comm.group import CommGroup
from paratrain.parallel.expert_parallel.groups import expert_range


class _AllToAll(torch.autograd.Function):
    """All-to-all with chunk sizes; backward sends the gradient back along the same links."""

    # torch leaves Function.apply unannotated: forward's arguments.
    apply: ClassVar[
        Callable[[torch.Tensor, list[int], list[int], CommGroup, str | None], torch.Tensor]
    ]

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        sends: list[int],
        recvs: list[int],
        group: CommGroup,
        algo: str | None,
    ) -> torch.Tensor:
        ctx.sends, ctx.recvs, ctx.group, ctx.algo = sends, recvs, group, algo
        return comm.all_to_all(x, group, sends, recvs, algo=algo)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        back = comm.all_to_all(grad.contiguous(), ctx.group, ctx.recvs, ctx.sends, algo=ctx.algo)
        return back, None, None, None, None


def all_to_all_rows(
    x: torch.Tensor, sends: list[int], recvs: list[int], group: CommGroup, algo: str | None = None
) -> torch.Tensor:
    """Differentiable all-to-all of rows: sends[p] rows of x to rank p, recvs[p] from it."""
    if group.size == 1:
        return x
    return _AllToAll.apply(x, sends, recvs, group, algo)


def shard_experts(experts: nn.Module, rank: int, ep: int) -> nn.Module:
    """A copy of `experts` keeping rank's E/ep experts: every parameter sliced along
    dimension 0 (the layer stacks its experts there; models/moe.py). The slices stand in
    for the parameters in the copy's memo: the whole tensors are never copied (and a
    deep copy of a fake tensor would belong to another fake mode: simulate/)."""
    memo: dict[int, object] = {}
    for p in experts.parameters():
        mine = expert_range(p.shape[0], rank, ep)
        sliced = p.detach()[mine.start : mine.stop].clone()
        memo[id(p)] = nn.Parameter(sliced, requires_grad=p.requires_grad)
    return copy.deepcopy(experts, memo)


class ExpertParallel(nn.Module):
    """Called as the layer's experts: (tokens grouped by expert (M, C), counts (E,)) ->
    the experts' outputs in the same order, computed on the ranks holding them."""

    def __init__(
        self, local: nn.Module, num_experts: int, group: CommGroup, algo: str | None = None
    ) -> None:
        super().__init__()
        expert_range(num_experts, group.rank, group.size)  # checks that ep divides E
        self.local, self.num_experts, self.group, self.algo = local, num_experts, group, algo

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ep, per_rank = self.group.size, self.num_experts // self.group.size
        mine = counts.view(ep, per_rank)  # (ep, E/ep): rows for each rank's experts
        arrived = comm.all_to_all(mine, self.group, algo=self.algo)  # (ep sources, E/ep)
        sends, recvs = mine.sum(1).tolist(), arrived.sum(1).tolist()
        rows = all_to_all_rows(x, sends, recvs, self.group, self.algo)  # (sum recvs, C)
        # Arrival order is (source, expert); the experts need (expert, source).
        source = torch.arange(ep, device=x.device).repeat_interleave(per_rank)  # per block
        expert = torch.arange(per_rank, device=x.device).repeat(ep)  # in arrival order
        key = (expert * ep + source).repeat_interleave(arrived.flatten())  # (sum recvs,)
        order = key.argsort(stable=True)
        y = self.local(rows[order], arrived.sum(0))  # (sum recvs, C), expert order
        back = torch.empty_like(y).index_copy(0, order, y)  # arrival order again
        return all_to_all_rows(back, recvs, sends, self.group, self.algo)  # (M, C)

    def extra_repr(self) -> str:
        mine = expert_range(self.num_experts, self.group.rank, self.group.size)
        return (
            f"ep_rank={self.group.rank}/{self.group.size}, "
            f"experts {mine.start}..{mine.stop - 1} of {self.num_experts}"
        )


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of split experts: reduced over the expert-dp group, not all of dp."""
    return [
        p
        for module in model.modules()
        if isinstance(module, ExpertParallel)
        for p in module.parameters()
    ]


def expert_placements(model: nn.Module) -> dict[str, tuple[str, int, int]]:
    """{name: (the plain model's name, ep rank, ep)} for every parameter of split experts:
    `<layer>.experts.local.w` is rows [rank·E/ep, (rank+1)·E/ep) of `<layer>.experts.w`
    (what a checkpoint stores, so that it loads on any ep)."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, ExpertParallel):
            for p_name, _ in module.local.named_parameters():
                whole = f"{name}.{p_name}" if name else p_name
                local = f"{name}.local.{p_name}" if name else f"local.{p_name}"
                out[local] = (whole, module.group.rank, module.group.size)
    return out


@torch.no_grad()
def whole_experts(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every split expert parameter whole, under the plain model's name: each gathered
    over its layer's ep group, in rank order (collective over every such group)."""
    out = {}
    for name, module in model.named_modules():
        if not isinstance(module, ExpertParallel):
            continue
        size = module.group.size
        for p_name, p in module.local.named_parameters():
            flat = comm.all_gather_flat(p.reshape(-1), module.group, sizes=[p.numel()] * size)
            out[f"{name}.{p_name}"] = flat.view(size * p.shape[0], *p.shape[1:])
    return out
