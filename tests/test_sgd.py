"""--optimizer sgd: plain SGD (parallel/data_parallel/sgd.py), whole and over ZeRO's shards,
with no optimizer state: the planner's prediction per rank, and an exact resume."""

from __future__ import annotations

import shutil

import pytest

from paratrain.validate import resolve_and_check
from tests.distributed import run_distributed
from tests.equivalence import tiny_config


def _sgd_config(zero: int, dp: int = 2):
    cfg = tiny_config(steps=4, global_batch=8, optimizer="sgd")
    cfg.parallel.nproc, cfg.parallel.dp, cfg.parallel.zero = dp, dp, zero
    cfg.train.microbatches = 0
    return resolve_and_check(cfg, dp)


def _tracked(rank: int, world: int, configs) -> list[dict]:
    from tests.equivalence import tiny_data
    from tests.test_prediction import train_and_compare

    return [train_and_compare(rank, world, cfg, tiny_data()) for cfg in configs]


def test_the_planner_counts_sgd_without_optimizer_state():
    """dp 2 whole, and under ZeRO-1, 2 and 3: no optimizer state at all, the rest of the
    model state and the bytes by group predicted = measured on every rank."""
    configs = [_sgd_config(zero) for zero in (0, 1, 2, 3)]
    for compared in run_distributed(_tracked, 2, configs):
        for c in compared:
            predicted, measured = c["predicted"], c["measured"]
            assert predicted["model_state_bytes"] == measured["model_state_bytes"]
            assert all(m["optimizer"] == 0 for m in measured["model_state_bytes"])
            assert predicted["bytes_sent_per_step"] == measured["bytes_sent_per_step"]


@pytest.mark.parametrize("zero", [0, 1])
def test_an_sgd_checkpoint_resumes_bitwise(tmp_path, zero):
    """Saved after step 2 of 4 and resumed on the same layout: steps 3 and 4 and the final
    parameters bitwise the uninterrupted run's."""
    import torch

    from tests.equivalence import run_and_record

    cfg = _sgd_config(zero)
    cfg.train.checkpoint_every = 2
    full = run_distributed(run_and_record, 2, cfg, str(tmp_path / "saved"), 0)
    shutil.copytree(tmp_path / "saved", tmp_path / "again")
    resumed = run_distributed(run_and_record, 2, cfg, str(tmp_path / "again"), 2)
    for whole, part in zip(full, resumed, strict=True):
        assert part.losses == whole.losses[2:]
        assert all(torch.equal(part.state[k], v) for k, v in whole.state.items())
