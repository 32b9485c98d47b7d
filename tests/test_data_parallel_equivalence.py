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

from paratrain import comm
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


def _skip_reduction(model, group):  # each replica keeps its own gradient
    pass


def _sum_reduction(model, group):  # sums instead of averaging: gradients k times too big
    for p in model.parameters():
        comm.all_reduce(p.grad, group, op="sum")


BROKEN = {"skip": _skip_reduction, "sum": _sum_reduction}


def train_on_ranks(rank, world_size, cfg, data, broken=None):
    if broken is not None:
        data_parallel.all_reduce_gradients = BROKEN[broken]
    mesh = Mesh.build(dp=world_size)
    result = train(cfg, mesh, data)
    state = copy.deepcopy(result.model.state_dict())
    return RunRecord([m.loss for m in result.metrics], [m.grad_norm for m in result.metrics], state)


@pytest.mark.parametrize("world_size, micro_batch", [(1, 8), (2, 4), (2, 2), (4, 2), (4, 1)])
def test_data_parallel_matches_single_process(world_size, micro_batch):
    cfg = tiny_config(micro_batch=micro_batch)
    cfg.parallel.dp = world_size
    cfg.train.microbatches = cfg.train.global_batch // (micro_batch * world_size)
    data = tiny_data()
    reference, initial = reference_training(cfg, data)
    records = run_distributed(train_on_ranks, world_size, cfg, data)
    for record in records:  # every replica ends with the same parameters
        assert_equivalent(record, reference, initial)


@pytest.mark.parametrize("broken", ["skip", "sum"])
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
