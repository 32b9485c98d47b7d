"""The mixture-of-experts layer, single process: the router's equations on hand-computed
cases, capacity and dropping, and the layer's one seam to the rest of the batch.

Hand cases are exact (small fractions in float64, compared to 1e-15). The sharded run in
`test_sharded_batch_equals_whole_batch` reorders nothing but the batch's split, so the
outputs agree to rounding (1e-12): each expert sees the same rows, in the same order.
"""

from __future__ import annotations

import math

import pytest
import torch

from paratrain.models.moe import Experts, MoE, MoEConfig
from paratrain.models.router import (
    Router,
    balance_bias,
    capacity,
    load_balancing_loss,
    queue_positions,
    slot_counts,
)

D, E = 8, 4


def model(**overrides) -> MoE:
    torch.manual_seed(0)
    fields = dict(d_model=D, num_experts=E, hidden=16, top_k=2, aux_loss_coef=0.01)
    layer = MoE(MoEConfig(**(fields | overrides))).double()
    torch.nn.init.normal_(layer.router.gate.weight, std=1.0)  # decisive, uneven routing
    return layer


def test_capacity_is_factor_times_k_tokens_over_experts_rounded_up():
    assert capacity(10, 4, 2, 1.25) == 7  # ceil(1.25 · 2 · 10 / 4) = ceil(6.25)
    assert capacity(8, 4, 1, 1.0) == 2
    assert capacity(8, 4, 1, None) is None


def test_queue_places_every_first_choice_before_any_second_choice():
    # 3 tokens, k = 2, E = 3; a shard of 2 tokens ahead chose expert 0 first twice and
    # expert 1 second twice.
    experts = torch.tensor([[0, 1], [1, 0], [0, 2]])
    here = slot_counts(experts, 3)  # [[2, 1, 0], [1, 1, 1]]
    before = torch.tensor([[2, 0, 0], [0, 2, 0]])
    total = before + here
    got = queue_positions(experts, before, total)
    # expert 0's queue: 2 first choices ahead, token 0, token 2 (slot 0), then the 2nd
    # choices: token 1's -> place 4. Expert 1: token 1's first choice (0), then the
    # second choices: 1 + 2 ahead, token 0 -> 3. Expert 2: token 2's second choice -> 0.
    assert got.tolist() == [[2, 3], [0, 4], [3, 0]]


def test_switch_loss_on_a_hand_computed_case():
    """α·E·Σ f_i P_i: argmax choices 0, 0, 0, 1 -> f = (3/4, 1/4); P = (0.65, 0.35);
    Σ f·P = 0.4875 + 0.0875 = 0.575; × E = 2 -> 1.15; × α = 0.1 -> 0.115."""
    p = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.6, 0.4], [0.3, 0.7]], dtype=torch.float64)
    load = torch.tensor([3, 1])
    got = load_balancing_loss(p, load, tokens=4, top_k=1, shards=1, coef=0.1)
    assert abs(got.item() - 0.115) < 1e-15
    # Two shards of two tokens, each scaled by `shards`: their mean is the batch's loss.
    halves = [load_balancing_loss(h, load, 4, 1, 2, 0.1) for h in p.split(2)]
    assert abs((halves[0] + halves[1]).item() / 2 - 0.115) < 1e-15
    # Perfect balance gives exactly α, the loss's minimum (Switch, section 2.2).
    uniform = torch.full((4, 4), 0.25, dtype=torch.float64)
    got = load_balancing_loss(uniform, torch.tensor([2, 2, 2, 2]), 4, 2, 1, 0.1)
    assert abs(got.item() - 0.1) < 1e-15


def test_bias_update_follows_the_sign_of_the_load_error():
    """Loads (5, 1, 2, 0), mean 2: overloaded expert 0 falls by γ, underloaded 1 and 3
    rise by γ, expert 2 at the mean stays (DeepSeek-V3, section 2.1.2)."""
    bias = torch.tensor([0.0, 0.0, 0.5, 0.0], dtype=torch.float64)
    balance_bias(bias, torch.tensor([5, 1, 2, 0]), rate=0.1)
    assert bias.tolist() == pytest.approx([-0.1, 0.1, 0.5, 0.1], abs=1e-15)


def test_bias_chooses_the_experts_but_not_their_weights():
    router = Router(2, 3, top_k=1).double()
    with torch.no_grad():
        router.gate.weight.copy_(torch.tensor([[1.0, 0.0], [0.5, 0.0], [0.0, 0.0]]))
        router.bias.copy_(torch.tensor([-1.0, 0.0, 0.0]))
    x = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    route = router(x)
    scores = torch.tensor([1.0, 0.5, 0.0], dtype=torch.float64).softmax(0)
    assert route.experts.tolist() == [[1]]  # 0's score is highest, but its bias is -1
    assert abs(route.weights.item() - scores[1].item()) < 1e-15
    route.weights.sum().backward()
    assert router.bias.grad is None  # a buffer: only balance_bias moves it


def test_tokens_over_capacity_are_dropped_and_come_out_as_zero():
    layer = model(top_k=1, capacity_factor=0.5)  # C = ceil(0.5 · 24 / 4) = 3
    seen = []
    layer.experts.register_forward_pre_hook(lambda m, args: seen.append(args[1].clone()))
    x = torch.randn(2, 12, D, dtype=torch.float64)
    y, _ = layer(x)
    stats = layer.stats
    assert stats.capacity == 3 and stats.tokens == 24
    assert (seen[0] <= 3).all() and torch.equal(seen[0], stats.kept)
    assert stats.dropped == 24 - int(stats.kept.sum()) > 0
    dropped_rows = (y.view(-1, D) == 0).all(1)
    assert int(dropped_rows.sum()) == stats.dropped  # k = 1: a dropped token gives 0
    # Without dropping nothing is zero.
    y, _ = model(top_k=1)(x)
    assert not (y.view(-1, D) == 0).all(1).any()


def test_a_layer_without_capacity_is_the_dense_mixture():
    """No dropping: each token's output is Σ_j w_j · expert_j(x) + shared(x), computed
    token by token with the experts' own weights."""
    layer = model(shared_hidden=8, activation="swiglu", normalize=True)
    x = torch.randn(5, D, dtype=torch.float64)
    y, _ = layer(x)
    route = layer.router(x)
    for t in range(5):
        want = layer.shared(x[t : t + 1], torch.tensor([1]))[0]
        for j in range(2):
            e = route.experts[t, j].item()
            counts = torch.zeros(E, dtype=torch.int64)
            counts[e] = 1
            want = want + route.weights[t, j] * layer.experts(x[t : t + 1], counts)[0]
        assert (y[t] - want).abs().max().item() < 1e-15
    assert layer.stats.dropped == 0 and layer.stats.capacity is None


class Shards:
    """The layer's batch view when the batch is cut into shards inside one process: the
    other shards' counts come from routing them with the same router."""

    def __init__(self, layer: MoE, shards: list[torch.Tensor], index: int) -> None:
        self.layer, self.pieces, self.shards, self.index = layer, shards, len(shards), index

    def gather(self, counts: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            every = [self.layer.router(s).experts for s in self.pieces]
        return torch.stack([slot_counts(e, self.layer.cfg.num_experts) for e in every])


@pytest.mark.parametrize("top_k, factor", [(1, 1.0), (2, 0.75), (2, None)])
def test_sharded_batch_equals_whole_batch(top_k, factor):
    """Capacity and statistics come from every shard's counts, so cutting the batch into
    3 shards changes no output, and the shards' aux losses average to the batch's."""
    layer = model(top_k=top_k, capacity_factor=factor, bias_rate=0.1)
    x = torch.randn(3 * 10, D, dtype=torch.float64)
    want, want_aux = layer(x)
    want_stats = layer.stats
    pieces = list(x.split(10))
    outs, auxes = [], []
    for i, piece in enumerate(pieces):
        layer.batch = Shards(layer, pieces, i)
        y, aux = layer(piece)
        outs.append(y)
        auxes.append(aux)
        assert torch.equal(layer.stats.kept, want_stats.kept)
    assert (torch.cat(outs) - want).abs().max().item() < 1e-12
    assert abs(sum(auxes).item() / 3 - want_aux.item()) < 1e-15
    assert math.isclose(layer.load.sum().item(), 4 * 30 * top_k)  # 1 whole + 3 shards


def test_experts_report_their_shape():
    assert "experts=4, d_model=8, hidden=16" in repr(Experts(4, 8, 16, "gelu"))


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("early_stop", [True, False])
def test_a_recomputed_forward_is_not_counted_again(mode, early_stop):
    """Activation recomputation runs a block's MoE forward again in backward. The layer
    counts its routing once per forward all the same: the load its balancing bias follows
    and the step's tally equal those of the model without recomputation. torch stops a
    recomputation once it has what backward needs (before the tally is taken), unless
    early stop is off: both ways."""
    from paratrain.models.gpt import GPT, GPTConfig
    from paratrain.models.moe import moe_layers
    from paratrain.parallel.recompute import apply_recomputation

    routing = MoEConfig(d_model=16, num_experts=4, hidden=32, capacity_factor=1.25,
                        bias_rate=0.01)  # fmt: skip
    cfg = GPTConfig(vocab_size=64, n_layer=2, n_head=2, d_model=16, max_seq_len=16, moe=routing)
    batch = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    counts = []
    for recompute in (False, True):
        torch.manual_seed(0)
        gpt = GPT(cfg).train()
        if recompute:
            apply_recomputation(gpt.blocks, mode)
        with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
            gpt(batch[:, :-1], batch[:, 1:]).backward()
        layers = moe_layers(gpt)
        counts.append([(m.load.tolist(), m.take_tally().forwards) for m in layers])
    assert counts[0] == counts[1]
    assert all(forwards == 1 and sum(load) > 0 for load, forwards in counts[0])
