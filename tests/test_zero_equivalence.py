"""ZeRO-1, 2 and 3 train exactly like plain single-process PyTorch (float32).

Exact in this setup: the data each step sees and the initial weights (every rank builds the
full model from the same seed before sharding it). Equal to float32 rounding: losses,
gradient norms and parameters, for the same reason as data parallelism (tests/
equivalence.py): the reduction adds the replicas' gradients in a different order, and
the sharded AdamW runs the same element-wise arithmetic on flat shards instead of on
each parameter. The global norm is a sum of per-shard squares (in float64) instead of
torch's norm of per-parameter norms, a difference of about 1e-7 relative.

Each test runs several configurations inside one multi-process run, since starting the
ranks costs more than training the tiny model.
"""

from __future__ import annotations

import pytest
import torch

from paratrain.mesh import Mesh
from paratrain.models.plans import GPT_PLAN
from paratrain.parallel.data_parallel.fsdp import FullyShardedDataParallel
from paratrain.parallel.data_parallel.fsdp_units import expand_units
from paratrain.parallel.data_parallel.zero import ZeroDataParallel
from paratrain.parallel.mixed_precision import MixedPrecision
from paratrain.train.build import build_model
from paratrain.train.engine import FlatEngine
from tests.distributed import run_distributed
from tests.equivalence import (
    RunRecord,
    assert_equivalent,
    reference_training,
    run_steps,
    tiny_config,
    tiny_data,
)


def wrap(model, group, stage, dtype="float32", **options):
    """The wrapper for a ZeRO stage: 0-2 ZeroDataParallel, 3 FullyShardedDataParallel."""
    precision = MixedPrecision.of(dtype)
    if stage == 3:
        units = expand_units(model, GPT_PLAN.fsdp_units)
        return FullyShardedDataParallel(model, group, units, precision, **options)
    return ZeroDataParallel(model, group, stage, precision, **options)


def train_sharded(cfg, mesh, data, stage, dtype="float32", **options):
    """The one training step (train/step.py) through a sharded wrapper built here, with
    options the CLI does not expose (tiny buckets)."""
    dp = mesh.group("dp")
    engine = FlatEngine(wrap(build_model(cfg), dp, stage, dtype, **options))
    losses, norms = run_steps(engine, cfg, data, dp)
    return RunRecord(losses, norms, engine.replica.full_state_dict()), engine.replica


def run_cases(rank, world_size, cases, data):
    mesh = Mesh.build(dp=world_size)
    return [train_sharded(cfg, mesh, data, stage, **opts)[0] for cfg, stage, opts in cases]


def _cases(world_size: int) -> list:
    """Stages 1-3, each without accumulation (K = 1) and with it (K = 2); ZeRO-2 with K = 2
    in both accumulations (the default reduce-scatters into the shard; "full")."""
    cases = []
    for stage in (1, 2, 3):
        for k_micro in (1, 2):
            micro = 8 // (world_size * k_micro)
            options = {"bucket_mb": 0.01} if stage < 3 else {"prefetch": 1}
            cases.append((tiny_config(micro_batch=micro), stage, options))
    cases.append((tiny_config(micro_batch=8 // (world_size * 2)), 2, {"accumulate": "full"}))
    return cases


@pytest.mark.parametrize("world_size", [pytest.param(2, marks=pytest.mark.equivalence), 4])
def test_zero_stages_match_single_process(world_size):
    """Every rank ends with the reference's parameters (gathered from the shards)."""
    data = tiny_data()
    cases = _cases(world_size)
    reference, initial = reference_training(cases[0][0], data)
    results = run_distributed(run_cases, world_size, cases, data)
    for rank_records in results:
        for (cfg, stage, opts), record in zip(cases, rank_records, strict=True):
            try:
                assert_equivalent(record, reference, initial)
            except AssertionError as e:
                raise AssertionError(
                    f"stage {stage} {opts} micro {cfg.train.micro_batch}: {e}"
                ) from e


def test_parameters_are_plain_module_parameters_after_sharding():
    """ZeRO-1/2 parameters stay usable in place: they are views of the flat buffer."""
    cfg = tiny_config()
    model = build_model(cfg)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    wrapped = ZeroDataParallel(model, Mesh.build().group("dp"), stage=2)
    for name, p in wrapped.module.named_parameters():
        assert torch.equal(p, before[name])
        assert p.untyped_storage().data_ptr() == wrapped.flat_params.untyped_storage().data_ptr()
