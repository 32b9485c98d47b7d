"""Activation recomputation: same losses and gradients, and only each block's input saved."""

from __future__ import annotations

import copy

import pytest
import torch

from paratrain.measure.activations import ActivationMeter
from paratrain.parallel.recompute import apply_recomputation
from paratrain.train.build import build_model
from tests.equivalence import tiny_config


def batch():
    return torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(0))


def measured(model):
    x = batch()
    regions = {f"block {i}": b for i, b in model.blocks.items()}
    with ActivationMeter(model, regions) as meter:
        loss = model(x[:, :-1], x[:, 1:])
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.item(), grads, meter


def test_recomputation_keeps_losses_and_gradients_and_saves_only_block_inputs():
    cfg = tiny_config()
    plain = build_model(cfg)
    recomputed = copy.deepcopy(plain)
    assert apply_recomputation(recomputed.blocks) == cfg.model.n_layer
    loss_a, grads_a, meter_a = measured(plain)
    loss_b, grads_b, meter_b = measured(recomputed)
    assert loss_a == loss_b
    for name, g in grads_a.items():
        assert torch.allclose(g, grads_b[name], atol=1e-7), name
    assert recomputed.state_dict().keys() == plain.state_dict().keys()
    b, t, c = 4, 16, cfg.model.d_model
    block_input = b * t * c * 4  # float32
    for i in range(cfg.model.n_layer):
        # Without recomputation a block saves many tensors; with it only its input, which
        # is the previous block's output and is attributed to the block that made it.
        assert meter_a.by_region[f"block {i}"] > 8 * block_input
        assert meter_b.by_region.get(f"block {i}", 0) <= block_input
    assert meter_b.total < meter_a.total / 2


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="recompute mode 'half'; valid: none, full"):
        apply_recomputation([], "half")
