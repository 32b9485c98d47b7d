"""Layer parity: each tensor-parallel layer equals the full layer it was sliced from.

Every rank builds the full layer and the full input from the same seed, runs the full
layer itself (the reference) and its tensor-parallel slice, and compares forward outputs,
input gradients and its slice of the weight gradients. Equal to float32 rounding only:
a split matmul or an all-reduced sum adds the same products in a different order. So each
comparison allows what tests/equivalence.py's rule derives from a float64 run of the same
full layer: the float32 reference's own distance from it, times SPREAD_FACTOR, at least
FLOOR_ULPS units of the largest value (`spread_bound`). The regions move or add ones and
copies: exact where no sum rounds (f, g, split and gather), bounded where one may (k
copies added: 3x rounds).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from paratrain.comm import regions
from paratrain.mesh import Mesh
from paratrain.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelCrossEntropy,
    VocabParallelEmbedding,
)
from tests.distributed import run_distributed
from tests.equivalence import spread_bound

B, T, C_IN, C_OUT, V = 2, 8, 12, 16, 32


def _chunk(t: torch.Tensor, dim: int, rank: int, k: int) -> torch.Tensor:
    return t.chunk(k, dim=dim)[rank]


def _close(actual: torch.Tensor, expected: torch.Tensor, exact: torch.Tensor, what: str) -> None:
    """actual within spread_bound of the float32 `expected` (`exact`: it in float64)."""
    assert actual.shape == expected.shape == exact.shape, (what, actual.shape, expected.shape)
    diff, bound = (actual - expected).abs().max().item(), spread_bound(expected, exact)
    assert diff <= bound, f"{what}: differs by {diff:.3g} > {bound:.3g}"


def _equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert torch.equal(actual, expected), f"{what}: not exactly {expected.flatten()[:4]}..."


def _in_float64(module: nn.Module, inputs: torch.Tensor, probe: torch.Tensor):
    """module's output, and the gradients of (output * probe).sum() for the inputs (None
    for indices) and the parameters, all computed in float64."""
    m = copy.deepcopy(module).double()
    m.zero_grad()
    x = inputs.detach().double() if inputs.is_floating_point() else inputs
    x.requires_grad_(inputs.is_floating_point())
    y = m(x)
    (y * probe.double()).sum().backward()
    return y.detach(), x.grad, {n: q.grad for n, q in m.named_parameters()}


def _column(rank, k):
    group = Mesh.build(tp=k).group("tp")
    for gather_output, sp in [(False, False), (True, False), (False, True)]:
        _column_case(group, rank, k, gather_output, sp)


def _column_case(group, rank, k, gather_output, sp):
    torch.manual_seed(0)
    full = nn.Linear(C_IN, C_OUT)
    x = torch.randn(B, T, C_IN, requires_grad=True)
    probe = torch.randn(B, T, C_OUT)  # a loss that weighs every output differently
    y64, gx64, g64 = _in_float64(full, x, probe)
    (full(x) * probe).sum().backward()

    layer = ColumnParallelLinear(full, group, gather_output=gather_output, sequence_parallel=sp)
    x_in = _chunk(x.detach(), 1, rank, k) if sp else x.detach()
    x_in.requires_grad_(True)
    y = layer(x_in)
    expected = full(x).detach()
    if not gather_output:
        expected, y64 = _chunk(expected, -1, rank, k), _chunk(y64, -1, rank, k)
    _close(y, expected, y64, "output")
    # With the output gathered every rank computes the whole loss; the gather's backward
    # keeps this rank's slice of dL/dy, so the weights still get exactly their share.
    (y * (probe if gather_output else _chunk(probe, -1, rank, k))).sum().backward()
    grad_x, gx64 = (_chunk(x.grad, 1, rank, k), _chunk(gx64, 1, rank, k)) if sp else (x.grad, gx64)
    _close(x_in.grad, grad_x, gx64, "input gradient")
    for name in ("weight", "bias"):
        mine, whole = getattr(layer, name).grad, getattr(full, name).grad
        _close(mine, _chunk(whole, 0, rank, k), _chunk(g64[name], 0, rank, k), f"{name} gradient")


@pytest.mark.parametrize("k", [2, 4])
def test_column_parallel_linear_matches_full_layer(k):
    """Output kept split, output gathered, and input split along the sequence (SP)."""
    run_distributed(_column, k)


def _row(rank, k):
    group = Mesh.build(tp=k).group("tp")
    for sp in (False, True):
        _row_case(group, rank, k, sp)


def _row_case(group, rank, k, sp):
    torch.manual_seed(0)
    full = nn.Linear(C_IN * 2, C_OUT)
    x = torch.randn(B, T, C_IN * 2, requires_grad=True)
    probe = torch.randn(B, T, C_OUT)
    y64, gx64, g64 = _in_float64(full, x, probe)
    (full(x) * probe).sum().backward()

    layer = RowParallelLinear(full, group, sequence_parallel=sp)
    x_in = _chunk(x.detach(), -1, rank, k).requires_grad_(True)  # (B, T, C_in / k)
    y = layer(x_in)
    expected, probe_mine = full(x).detach(), probe
    if sp:  # the output holds this rank's tokens only
        expected, probe_mine = _chunk(expected, 1, rank, k), _chunk(probe, 1, rank, k)
        y64 = _chunk(y64, 1, rank, k)
    _close(y, expected, y64, "output")
    (y * probe_mine).sum().backward()
    _close(x_in.grad, _chunk(x.grad, -1, rank, k), _chunk(gx64, -1, rank, k), "input gradient")
    weight64 = _chunk(g64["weight"], 1, rank, k)
    _close(layer.weight.grad, _chunk(full.weight.grad, 1, rank, k), weight64, "weight gradient")
    if sp:  # partial over tokens until sync_sequence_parallel_grads sums it
        bias_grad, bias64 = probe_mine.sum(dim=(0, 1)), probe_mine.double().sum(dim=(0, 1))
        _close(layer.bias.grad, bias_grad, bias64, "bias gradient (local tokens)")
    else:  # whole on every rank: added once, after the all-reduce
        _close(layer.bias.grad, full.bias.grad, g64["bias"], "bias gradient")


@pytest.mark.parametrize("k", [2, 4])
def test_row_parallel_linear_matches_full_layer(k):
    """Output all-reduced, and reduce-scattered along the sequence (SP)."""
    run_distributed(_row, k)


def _embedding(rank, k):
    group = Mesh.build(tp=k).group("tp")
    for sp in (False, True):
        _embedding_case(group, rank, k, sp)


def _embedding_case(group, rank, k, sp):
    torch.manual_seed(0)
    full = nn.Embedding(V, C_OUT)
    ids = torch.randint(0, V, (B, T))
    probe = torch.randn(B, T, C_OUT)
    y64, _, g64 = _in_float64(full, ids, probe)
    (full(ids) * probe).sum().backward()

    layer = VocabParallelEmbedding(full, group, sequence_parallel=sp)
    y = layer(ids)
    expected, probe_mine = full(ids).detach(), probe
    if sp:
        expected, probe_mine = _chunk(expected, 1, rank, k), _chunk(probe, 1, rank, k)
        y64 = _chunk(y64, 1, rank, k)
    _close(y, expected, y64, "output")
    (y * probe_mine).sum().backward()
    weight64 = _chunk(g64["weight"], 0, rank, k)
    _close(layer.weight.grad, _chunk(full.weight.grad, 0, rank, k), weight64, "weight gradient")


@pytest.mark.parametrize("k", [2, 4])
def test_vocab_parallel_embedding_matches_full_embedding(k):
    run_distributed(_embedding, k)


def _loss(rank, k):
    group = Mesh.build(tp=k).group("tp")
    torch.manual_seed(0)
    n = B * T
    logits = (torch.randn(n, V) * 5).requires_grad_(True)  # large: exercises the max shift
    targets = torch.randint(0, V, (n,))
    targets[::5] = -100  # ignored tokens do not count in the mean
    expected = F.cross_entropy(logits, targets, ignore_index=-100)
    expected.backward()
    logits64 = logits.detach().double().requires_grad_(True)
    exact = F.cross_entropy(logits64, targets, ignore_index=-100)
    exact.backward()

    loss_fn = VocabParallelCrossEntropy(group, ignore_index=-100)
    mine = _chunk(logits.detach(), -1, rank, k).requires_grad_(True)  # (N, V / k)
    loss = loss_fn(mine, targets)
    _close(loss, expected.detach(), exact.detach(), "loss")
    loss.backward()
    grad64 = _chunk(logits64.grad, -1, rank, k)
    _close(mine.grad, _chunk(logits.grad, -1, rank, k), grad64, "logit gradient")
    # The traffic is per token, never per vocabulary entry: (N,) max and (2, N) sums.
    recent = [r.shapes for r in group.ledger.recent() if r.op == "all_reduce"]
    assert recent == [f"float32[{n}]", f"float32[2, {n}]"], recent


@pytest.mark.parametrize("k", [2, 4])
def test_vocab_parallel_cross_entropy_matches_full_softmax(k):
    run_distributed(_loss, k)


def _regions(rank, k):
    """f and g, gather and split, and the sequence pair are each other's adjoints."""
    group = Mesh.build(tp=k).group("tp")
    torch.manual_seed(rank)  # a different tensor per rank
    x = torch.randn(2, 4 * k, 3, requires_grad=True)
    ones = torch.ones(())
    # f: identity forward; the gradient is summed over ranks.
    regions.f(x, group).sum().backward()
    _equal(x.grad, torch.full_like(x, k), "f backward")  # k ones: every sum exact
    # g: the forward sums over ranks; the gradient passes through unchanged.
    x.grad = None
    total = regions.g(x, group)
    total.sum().backward()
    _equal(x.grad, torch.ones_like(x), "g backward")
    # gather_sequence then reduce_scatter_sequence recovers k times the input (sum of k
    # equal copies); the gradient of the pair is k as well.
    x.grad = None
    round_trip = regions.reduce_scatter_sequence(regions.gather_sequence(x, group), group)
    exact = x.detach().double() * k  # k copies added: 3x may round
    _close(round_trip, x.detach() * k, exact, "sequence round trip")
    round_trip.sum().backward()
    _equal(x.grad, torch.full_like(x, k), "sequence round trip backward")
    # split then gather is the identity (on a tensor equal on every rank), and so is its
    # backward.
    torch.manual_seed(0)
    same = torch.randn(2, 4 * k, 3, requires_grad=True)
    back = regions.gather_slices(regions.split(same, group, dim=1), group, dim=1)
    _equal(back, same.detach(), "split/gather")  # moved, not computed
    (back * ones).sum().backward()
    _equal(same.grad, torch.ones_like(same), "split/gather backward")


@pytest.mark.parametrize("k", [2, 4])
def test_regions_are_adjoint_pairs(k):
    run_distributed(_regions, k)


def test_regions_skip_the_collective_on_one_rank():
    group = Mesh.build().group("tp")
    x = torch.randn(2, 4, 3)
    for op in (regions.f, regions.g, regions.gather_sequence, regions.reduce_scatter_sequence):
        assert op(x, group) is x
    assert group.ledger.totals() == {}
