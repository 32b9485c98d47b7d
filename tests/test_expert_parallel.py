"""Expert parallelism is invisible to the numbers, and its all-to-alls cost the formulas.

In float64, at ep 1, 2, 4 (ep = the data-parallel degree) and at dp 4 x ep 2 (two
replicas of every expert), each rank's MoE output, the mean of the ranks' auxiliary
losses, the routing statistics, the bias after balancing and every gradient after
`reduce_gradients` equal the single-process layer run on the whole batch, to 1e-10. They
are equal up to rounding, not bitwise: an expert's matmul sees its rows in a different
batch, and gradients are summed over ranks in another order. Dispatch followed by
combine moves values only, so that round trip is bitwise exact, forward and backward.
The ledger's all-to-all bytes per rank equal plan/expert_cost.py's formulas for the token
counts that the single-process routing implies, so the check is independent of the dispatch's code;
one configuration runs the pairwise all-to-all, whose bytes the ledger takes from what
was sent rather than from the native call's split sizes.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from paratrain.comm.group import CommGroup
from paratrain.comm.ledger import Ledger
from paratrain.models.moe import MoE, MoEConfig
from paratrain.models.router import queue_positions, slot_counts
from paratrain.parallel.expert_parallel import (
    ExpertParallel,
    apply_expert_parallel,
    expert_groups,
    expert_range,
    reduce_gradients,
)
from paratrain.plan.expert_cost import (
    counts_bytes,
    expected_token_bytes,
    token_bytes,
)
from tests.distributed import run_distributed

D, E, N = 8, 4, 12  # model width, experts, tokens per rank
TOL = 1e-10
CONFIGS = {  # each exercises another branch; capacity 1.0 and 0.5 drop tokens
    "switch": dict(top_k=1, capacity_factor=1.0, aux_loss_coef=0.01),
    "top2_shared": dict(
        top_k=2, bias_rate=0.1, shared_hidden=8, activation="swiglu", normalize=True
    ),
    "top2_sigmoid": dict(top_k=2, capacity_factor=0.5, score="sigmoid", bias_rate=0.05),
}


def test_groups_of_dp4_ep2():
    g = expert_groups(4, 2)
    assert g.ep == [[0, 1], [2, 3]] and g.expert_dp == [[0, 2], [1, 3]]
    assert g.dp == [0, 1, 2, 3] and g.ep_of(3) == [2, 3] and g.expert_dp_of(3) == [1, 3]
    assert expert_groups(4, 4).expert_dp == [[0], [1], [2], [3]]
    assert list(expert_range(8, 1, 4)) == [2, 3]
    with pytest.raises(ValueError, match="4 % 3 = 1"):
        expert_groups(4, 3)
    with pytest.raises(ValueError, match="6 % 4 = 2"):
        expert_range(6, 0, 4)


def test_uniform_routing_formula_is_the_mean_of_the_counted_one():
    # k·N assignments spread evenly over ep ranks: N·k/ep rows to each rank, as many back.
    ep, k, rows = 4, 2, 12
    even = [rows * k // ep] * ep
    assert token_bytes(even, even, 0, D, 8) == expected_token_bytes(rows, k, ep, D, 8)
    assert counts_bytes(8, 4) == 3 * 2 * 8


def build_groups(rank: int, world: int, ep: int, ledger: Ledger) -> tuple[CommGroup, ...]:
    """dp, ep and expert-dp groups from the pure layout; every rank creates every group."""
    layout = expert_groups(world, ep)
    made = []
    for name, groups in (("ep", layout.ep), ("expert_dp", layout.expert_dp)):
        mine = next(g for g in groups if rank in g)
        if len(mine) == world:
            made.append(CommGroup.world(ledger, name=name))
            continue
        own = None
        for ranks in groups:
            pg = dist.new_group(ranks) if len(ranks) > 1 else None
            own = pg if ranks == mine else own
        made.append(CommGroup(name, own, mine, rank, ledger))
    return (CommGroup.world(ledger, name="dp"), *made)


def oracle_layer(overrides: dict) -> MoE:
    torch.manual_seed(0)
    layer = MoE(MoEConfig(d_model=D, num_experts=E, hidden=16, **overrides)).double()
    nn.init.normal_(layer.router.gate.weight, std=1.0)  # decisive, uneven routing
    with torch.no_grad():
        layer.router.bias.normal_(std=0.05 if layer.cfg.bias_rate else 0.0)
    return layer


def rows_sent(layer: MoE, x: torch.Tensor, world: int, ep: int, rank: int) -> list[int]:
    """From the oracle's routing of the whole batch: rows `rank` sends to each ep rank."""
    with torch.no_grad():
        experts = layer.router(x).experts  # (T, k)
    keep = torch.ones_like(experts, dtype=torch.bool)
    if layer.stats.capacity is not None:
        counts = slot_counts(experts, E)
        keep = queue_positions(experts, torch.zeros_like(counts), counts) < layer.stats.capacity
    mine = (torch.arange(x.shape[0]) // N == rank).unsqueeze(1) & keep
    return [int((mine & (experts // (E // ep) == p)).sum()) for p in range(ep)]


def compare(what: str, got: torch.Tensor, want: torch.Tensor, failures: list[str]) -> None:
    err = (got - want).abs().max().item() if got.numel() else 0.0
    if not err <= TOL:
        failures.append(f"{what} differs by {err:.2e}")


def check_layout(rank: int, world: int, ep: int) -> list[str]:
    ledger = Ledger()
    dp, ep_group, expert_dp = build_groups(rank, world, ep, ledger)
    held = expert_range(E, ep_group.rank, ep)
    g = torch.Generator().manual_seed(1)
    x_all = torch.randn(world * N, D, generator=g, dtype=torch.float64)
    w_all = torch.randn(world * N, D, generator=g, dtype=torch.float64)
    mine = slice(rank * N, (rank + 1) * N)
    failures: list[str] = []
    for name, overrides in CONFIGS.items():
        what = f"rank {rank}/{world} ep={ep} {name}"
        oracle = oracle_layer(overrides)
        # pairwise: the ledger counts the messages our exchange sent, not a formula.
        algo = "pairwise" if name == "top2_sigmoid" else None
        layer = apply_expert_parallel(copy.deepcopy(oracle), [""], ep_group, dp, algo)
        arriving = []
        layer.experts.local.register_forward_pre_hook(lambda m, a: arriving.append(a[1]))
        # Single process: the whole batch; the loss is the mean over its tokens.
        xo = x_all.clone().requires_grad_()
        y_want, aux_want = oracle(xo)
        ((y_want * w_all).sum() / (world * N) + aux_want).backward()
        # This rank: its shard; data parallelism averages the shards' losses.
        x = x_all[mine].clone().requires_grad_()
        ledger.reset()
        y, aux = layer(x)
        forward = ledger.totals().get(("ep", "all_to_all"))
        ledger.reset()
        ((y * w_all[mine]).sum() / N + aux).backward()
        backward = ledger.totals().get(("ep", "all_to_all"))
        reduce_gradients(layer, dp, expert_dp)
        compare(f"{what}: output", y, y_want[mine], failures)
        compare(f"{what}: input gradient", x.grad / world, xo.grad[mine], failures)
        aux_mean = aux.detach().clone()
        if world > 1:
            dist.all_reduce(aux_mean)
        compare(f"{what}: aux loss", aux_mean / world, aux_want.detach(), failures)
        for pname, p in layer.named_parameters():
            ref = oracle.get_parameter(pname.replace("local.", ""))
            ref_grad = ref.grad[held.start : held.stop] if ".local." in pname else ref.grad
            compare(f"{what}: grad {pname}", p.grad, ref_grad, failures)
        s, o = layer.stats, oracle.stats
        same = torch.equal(s.kept, o.kept) and torch.equal(s.load, o.load)
        if (s.capacity, s.dropped) != (o.capacity, o.dropped) or not same:
            failures.append(f"{what}: stats {s} != {o}")
        if name == "top2_sigmoid" and o.dropped == 0:
            failures.append(f"{what}: the case meant to drop tokens dropped none")
        if o.capacity is not None and (arriving[0] > o.capacity).any():
            failures.append(f"{what}: {arriving[0].tolist()} rows over capacity {o.capacity}")
        sends = rows_sent(oracle, x_all, world, ep, rank)
        base = rank - ep_group.rank  # the ep group's first global rank
        recvs = [rows_sent(oracle, x_all, world, ep, base + p)[ep_group.rank] for p in range(ep)]
        rows = token_bytes(sends, recvs, ep_group.rank, D, 8)
        want = (counts_bytes(E, ep) + rows, rows)
        got = tuple(t.bytes_sent if t else 0 for t in (forward, backward))
        if ep > 1 and got != want:
            failures.append(f"{what}: all_to_all bytes (fwd, bwd) {got} != formula {want}")
        # After the bytes: rows_sent routes with the bias of this step.
        start = oracle.router.bias.clone()
        layer.balance_bias()
        oracle.balance_bias()
        compare(f"{what}: bias", layer.router.bias, oracle.router.bias, failures)
        if oracle.cfg.bias_rate and torch.equal(start, oracle.router.bias):
            failures.append(f"{what}: the bias did not move")
    return failures


def test_ep1_in_one_process_equals_the_layer():
    assert check_layout(0, 1, 1) == []


@pytest.mark.parametrize(
    "world, ep",
    [(2, 1), pytest.param(2, 2, marks=pytest.mark.equivalence), (4, 4), (4, 2)],
    ids=["dp2xep1", "ep2", "ep4", "dp4xep2"],
)
def test_expert_parallel_equals_single_process(world, ep):
    failures = [f for rank in run_distributed(check_layout, world, ep) for f in rank]
    assert not failures, "\n".join(failures[:20])


class Tagged(nn.Module):
    """Local experts that return their input, after checking that every row arrived at
    the expert its first column names, grouped by expert."""

    def __init__(self, first: int) -> None:
        super().__init__()
        self.first, self.wrong = first, 0

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ids = torch.arange(self.first, self.first + counts.numel()).repeat_interleave(counts)
        self.wrong += int((x[:, 0] != ids.to(x.dtype)).sum())
        return x


def round_trip(rank: int, world: int) -> tuple[bool, bool, int]:
    group = CommGroup.world(Ledger(), name="ep")
    g = torch.Generator().manual_seed(rank)
    counts = torch.randint(0, 4, (2 * world,), generator=g)  # 2 experts per rank, some 0
    x = torch.randn(int(counts.sum()), 5, generator=g, dtype=torch.float64)
    x[:, 0] = torch.arange(2 * world).repeat_interleave(counts).to(x.dtype)  # the expert
    x.requires_grad_()
    local = Tagged(2 * rank)
    y = ExpertParallel(local, 2 * world, group)(x, counts)
    upstream = torch.randn(y.shape, generator=g, dtype=torch.float64)
    y.backward(upstream)
    return torch.equal(y, x), torch.equal(x.grad, upstream), local.wrong


@pytest.mark.parametrize("world", [2, 3])
def test_dispatch_then_combine_is_exact(world):
    assert run_distributed(round_trip, world) == [(True, True, 0)] * world
