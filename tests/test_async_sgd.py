"""Asynchronous (parameter-server) data parallelism: staleness, stragglers, DC-ASGD, and a
loss close to synchronous training on the same samples."""

from __future__ import annotations

import torch

from paratrain.mesh import Mesh
from paratrain.parallel.data_parallel.dc_asgd import dc_asgd_correct
from paratrain.train.async_loop import train_async
from tests.distributed import run_distributed
from tests.equivalence import tiny_config, tiny_data


def test_dc_asgd_matches_its_formula():
    g = torch.tensor([0.5, -2.0, 0.0, 1.0], dtype=torch.float64)
    w_now = torch.tensor([1.0, 1.0, 3.0, -1.0], dtype=torch.float64)
    w_pulled = torch.tensor([0.0, 2.0, 1.0, -1.0], dtype=torch.float64)
    lam = 0.3
    expected = [0.5 + 0.3 * 0.25 * 1.0, -2.0 + 0.3 * 4.0 * -1.0, 0.0, 1.0]
    assert dc_asgd_correct(g, w_now, w_pulled, lam).tolist() == expected
    assert torch.equal(dc_asgd_correct(g, w_now, w_pulled, 0.0), g)


def run(rank, world_size, cfg, data):
    result = train_async(cfg, Mesh.build(dp=world_size), data)
    return [m.loss for m in result.metrics], result.val_loss, result.extra.get("async")


def async_config(steps: int, **parallel) -> object:
    cfg = tiny_config(steps=steps, micro_batch=2, lr=3e-3, warmup_steps=3)
    cfg.parallel.dp_mode = "async"
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    return cfg


def test_a_5x_straggler_pushes_less_and_staleness_is_recorded():
    # Rank 2 (a worker) computes 5x slower. Each push also pays the server round trip,
    # which on this tiny model is comparable to the compute, so the push ratio sits well
    # below 5 (about 3 measured on a quiet machine; CI saw 1.9 with a 3x straggler), and
    # with other processes busy on the CPUs the server's share of the round trip grows.
    cfg = async_config(steps=20, straggler="2:5")
    _, _, extra = run_distributed(run, 3, cfg, tiny_data())[0]
    pushes = extra["pushes_by_worker"]
    assert extra["updates"] == 40 and sum(pushes.values()) == 40
    assert pushes[1] >= 1.5 * pushes[2], pushes
    assert extra["staleness_max"] > 0 and extra["staleness_mean"] > 0


def test_staleness_bound_drops_stale_gradients():
    # 5x over 30 steps, not 3x over 10: the straggler sleeps in proportion to its step's
    # work, and its first step (warm-up) is many times a later one, so worker 1 could make
    # all 20 updates before worker 2's first push arrived (answered STOP, neither applied
    # nor dropped): a run with nothing dropped happened in CI, 2026-12-04. Each push also
    # pays the server's round trip, comparable to a compute here: at 5x worker 1 still
    # makes several updates while worker 2 computes one.
    cfg = async_config(steps=30, straggler="2:5", staleness_bound=1)
    _, _, extra = run_distributed(run, 3, cfg, tiny_data())[0]
    assert extra["updates"] == 60 and extra["dropped"] > 0
    assert extra["staleness_max"] <= 1


def test_async_reaches_a_loss_close_to_sync_on_the_same_samples():
    """Async must not end more than 0.15 nats of validation loss above sync after the same
    samples (30 steps of G sequences). It makes W = 2 optimizer updates of G / W sequences
    where sync makes one of G, so on this short run it usually ends lower (measured here:
    3.02 async against 3.58 sync); staleness is what could make it worse. A no-op
    compensation passes this too: tests/test_dc_asgd.py shows that DC-ASGD helps."""
    data = tiny_data()
    sync = tiny_config(steps=30, micro_batch=2, lr=3e-3, warmup_steps=3)
    sync.parallel.dp = 2
    _, sync_val, _ = run_distributed(run, 2, sync, data)[0]
    for dc_lambda, mode in ((0.0, "constant"), (0.5, "adaptive")):
        cfg = async_config(steps=30, dc_lambda=dc_lambda, dc_mode=mode)
        losses, async_val, extra = run_distributed(run, 3, cfg, data)[0]
        assert extra["updates"] == 60
        assert extra["compensation"] == (mode if dc_lambda else "none")  # the config's
        assert losses[-1] < losses[0] - 1.0  # it trained
        assert async_val < sync_val + 0.15, (dc_lambda, async_val, sync_val)
