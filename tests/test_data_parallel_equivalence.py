"""Data-parallel training equals single-process training on the whole batch.

Exact in this setup: the data each step sees (the sampler depends only on seed and step)
and the initial weights (every rank builds the model from the same seed). Equal to float32
rounding: the losses, gradient norms and parameters, since averaging over replicas and
micro-batches adds the same terms in a different order (tolerances in equivalence.py).
"""

from __future__ import annotations

import copy

import pytest
import torch

from paratrain.comm import CommOptions
from paratrain.mesh import Mesh
from paratrain.parallel import data_parallel
from paratrain.train.loop import train
from tests.distributed import RankFailed, run_distributed
from tests.equivalence import (
    RunRecord,
    assert_equivalent,
    reference_training,
    tiny_config,
    tiny_data,
)


def _break(mode):
    """Sabotage the gradient reduction in this worker process only."""
    if mode == "skip":  # each replica keeps its own gradient

        def launch(self, force=False):
            self._next_launch = len(self.buckets)

        data_parallel.DataParallel._launch_ready = launch
    elif mode == "avg":  # averages token-normalised gradients: k times too small
        original = data_parallel.DataParallel.__init__

        def init(self, *args, **kwargs):
            original(self, *args, **kwargs)
            self.reduce_op = "avg"

        data_parallel.DataParallel.__init__ = init


def train_on_ranks(rank, world_size, cfg, data, broken=None, algo="native"):
    if broken is not None:
        _break(broken)
    mesh = Mesh.build(dp=world_size, options=CommOptions(algo=algo))
    result = train(cfg, mesh, data)
    state = copy.deepcopy(result.model.state_dict())
    return RunRecord([m.loss for m in result.metrics], [m.grad_norm for m in result.metrics], state)


@pytest.mark.parametrize(
    "world_size, micro_batch, bucket_mb",
    [
        (1, 8, 25),
        pytest.param(2, 4, 25, marks=pytest.mark.equivalence),
        (2, 2, 0.01),
        (4, 2, 0),
        (4, 1, 0.003),
    ],
)
def test_data_parallel_matches_single_process(world_size, micro_batch, bucket_mb):
    """With and without accumulation (K = 1, 2), one bucket, uneven small buckets."""
    cfg = tiny_config(micro_batch=micro_batch)
    cfg.parallel.dp = world_size
    cfg.parallel.bucket_mb = bucket_mb
    cfg.train.microbatches = cfg.train.global_batch // (micro_batch * world_size)
    data = tiny_data()
    reference, initial = reference_training(cfg, data)
    records = run_distributed(train_on_ranks, world_size, cfg, data)
    for record in records:  # every replica ends with the same parameters
        assert_equivalent(record, reference, initial)


@pytest.mark.parametrize("algo", ["ring", "tree"])
def test_our_algorithms_train_like_native(algo):
    cfg = tiny_config(micro_batch=2)
    cfg.parallel.dp = 2
    cfg.parallel.bucket_mb = 0.01
    data = tiny_data()
    reference, initial = reference_training(cfg, data)
    records = run_distributed(train_on_ranks, 2, cfg, data, None, algo)
    assert_equivalent(records[0], reference, initial)


@pytest.mark.parametrize("broken", ["skip", "avg"])
def test_equivalence_helper_catches_a_broken_reduction(broken):
    cfg = tiny_config(micro_batch=4)
    cfg.parallel.dp = 2
    data = tiny_data()
    reference, initial = reference_training(cfg, data)
    records = run_distributed(train_on_ranks, 2, cfg, data, broken)
    with pytest.raises(AssertionError):
        assert_equivalent(records[0], reference, initial)


def test_parameters_start_equal_on_every_rank():
    cfg = tiny_config(steps=1)
    records = run_distributed(train_on_ranks, 2, cfg, tiny_data())
    for name, value in records[0].state.items():
        assert torch.equal(value, records[1].state[name]), name


def test_a_failing_rank_is_reported_with_its_traceback():
    with pytest.raises(RankFailed, match="(?s)rank 1 of 2 failed.*ZeroDivisionError"):
        run_distributed(_fail_on_rank_one, 2)


def _fail_on_rank_one(rank, world_size):
    if rank == 1:
        return 1 / 0
    return rank
