"""`paratrain train --pp P` through the training loop: pipeline x data parallel equals
single-process training (the loop's engine, clipping and data sharding, not only the
runtime). Tolerances and the reference are those of tests/equivalence.py."""

from __future__ import annotations

import copy

import pytest

from paratrain.mesh import Mesh
from paratrain.train.loop import train
from paratrain.validate import resolve_and_check
from tests.distributed import run_distributed
from tests.equivalence import (
    RunRecord,
    assert_equivalent,
    reference_training,
    tiny_config,
    tiny_data,
)

CASES = {
    4: [("1f1b", 1, 2, 2), ("interleaved", 2, 2, 2)],  # (schedule, chunks, dp, micro_batch)
    2: [("gpipe", 1, 1, 2), ("zb-h1", 1, 1, 1)],
}


def case_config(world: int, schedule: str, chunks: int, dp: int, micro_batch: int):
    cfg = tiny_config(micro_batch=micro_batch)
    cfg.model.n_layer = 4
    cfg.parallel.nproc, cfg.parallel.pp, cfg.parallel.dp = world, world // dp, dp
    cfg.parallel.schedule, cfg.parallel.chunks = schedule, chunks
    cfg.train.microbatches = 0
    return resolve_and_check(cfg, world)


def run_cases(rank, world_size, data):
    records = []
    for schedule, chunks, dp, micro_batch in CASES[world_size]:
        cfg = case_config(world_size, schedule, chunks, dp, micro_batch)
        result = train(cfg, Mesh.build(dp=dp, pp=world_size // dp), data)
        state = {}
        for chunk in result.model if hasattr(result.model, "__len__") else [result.model]:
            state.update(copy.deepcopy(chunk.state_dict()))
        records.append(
            RunRecord(
                [m.loss for m in result.metrics], [m.grad_norm for m in result.metrics], state
            )
        )
    return records


@pytest.mark.parametrize("world", [2, 4])
def test_pipeline_through_the_loop_matches_single_process(world):
    data = tiny_data()
    per_rank = run_distributed(run_cases, world, data)
    for i, (schedule, chunks, dp, micro_batch) in enumerate(CASES[world]):
        cfg = case_config(world, schedule, chunks, dp, micro_batch)
        assert cfg.train.microbatches == cfg.train.global_batch // (micro_batch * dp)
        reference, initial = reference_training(cfg, data)
        state = {}
        for records in per_rank:  # every stage's parameters, from each dp replica
            state.update(records[i].state)
        whole = RunRecord(per_rank[0][i].losses, per_rank[0][i].grad_norms, state)
        assert_equivalent(whole, reference, initial)
        for records in per_rank:  # every rank reports the same loss
            assert records[i].losses == per_rank[0][i].losses
