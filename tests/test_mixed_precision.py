"""Mixed precision: bf16 compute with fp32 master weights tracks fp32 training; fp16's
dynamic loss scale skips overflowing steps and recovers. (16 bytes per parameter, and
4N + 12N/k, 2N + 14N/k, 16N/k under ZeRO, are checked in test_zero_accounting.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from paratrain.mesh import Mesh
from paratrain.parallel.data_parallel.zero import ZeroDataParallel
from paratrain.parallel.mixed_precision import (
    DynamicLossScaler,
    MixedPrecision,
    parse_dtype,
    scale_backward,
)
from paratrain.train.build import build_model
from paratrain.train.engine import FlatEngine
from paratrain.train.step import train_step
from tests.distributed import run_distributed
from tests.equivalence import reference_training, tiny_config, tiny_data
from tests.test_zero_equivalence import train_sharded

# bf16 keeps 8 bits of mantissa, so logits, activations and gradients round at about
# 0.4%, and the loss itself is computed (and reported) in bf16. Measured over 4 steps of
# the tiny GPT at dp 2, every stage: losses within 0.2% of the fp32 reference; the total
# parameter update (final - initial, all parameters) within 6% of the fp32 update in L2
# (cosine 0.998). Elementwise bounds mean little here: Adam's first steps move each weight
# by about lr * sign(gradient), so a near-zero gradient whose sign flips under rounding
# moves its weight a whole step the other way. Bounds: loss 1%, update 15%. Between
# stages, bf16 runs agree with each other to 0.3% of the update (measured; the gradients'
# bf16 buffers are summed in a different order); bound 1%.
BF16_LOSS_RTOL = 1e-2
BF16_UPDATE_RTOL = 0.15
BF16_STAGES_RTOL = 1e-2


def update(state: dict, initial: dict) -> torch.Tensor:
    return torch.cat([(state[n] - initial[n]).flatten() for n in initial])


def bf16_runs(rank, world_size, data):
    mesh = Mesh.build(dp=world_size)
    records = []
    for stage in (0, 1, 2, 3):
        record, model = train_sharded(tiny_config(micro_batch=4), mesh, data, stage, "bfloat16")
        dtypes = {p.dtype for p in model.module.parameters()}
        records.append((record, dtypes))
    return records


def test_bf16_tracks_fp32_within_a_stated_bound():
    data = tiny_data()
    reference, initial = reference_training(tiny_config(micro_batch=4), data)
    for records in run_distributed(bf16_runs, 2, data):
        for stage, (record, dtypes) in enumerate(records):
            assert dtypes == {torch.bfloat16}, stage  # the compute copy is bf16
            for a, b in zip(record.losses, reference.losses, strict=True):
                assert math.isclose(a, b, rel_tol=BF16_LOSS_RTOL), (stage, a, b)
            for name, value in record.state.items():
                assert value.dtype == torch.float32, name  # the master values
            ours, ref = update(record.state, initial), update(reference.state, initial)
            assert (ours - ref).norm() <= BF16_UPDATE_RTOL * ref.norm(), stage
            first = update(records[0][0].state, initial)
            assert (ours - first).norm() <= BF16_STAGES_RTOL * ref.norm(), stage


def fp16_run(rank, world_size):
    cfg = tiny_config(micro_batch=4)
    precision = MixedPrecision(torch.float16, initial_loss_scale=2.0**20, growth_interval=2)
    model = ZeroDataParallel(build_model(cfg), Mesh.build(dp=world_size).group("dp"), 1, precision)
    engine = FlatEngine(model)
    opt = engine.build_optimizer(1e-2, 0.1, (0.9, 0.95))
    g = torch.Generator().manual_seed(rank)
    batch = torch.randint(0, 256, (4, 17), generator=g)  # learned by heart: the loss falls
    losses, scales, overflows = [], [], 0
    for _ in range(30):
        out = train_step(engine, opt, [batch], 1e-2, 1.0)
        losses.append(out.loss)
        scales.append(model.scaler.scale)
        overflows += out.overflow
    assert overflows == model.scaler.skipped  # the step saw every skip the scaler made
    return losses, scales, model.scaler.skipped


def test_fp16_loss_scale_skips_overflowing_steps_and_recovers():
    """The largest gradient here is about 3400 at scale 2^8, so 2^20 overflows fp16 (max
    65504): steps are skipped and the scale halves until the gradients fit (about 2^12);
    then every second good step doubles it again (growth interval 2) until it overflows."""
    for losses, scales, skipped in run_distributed(fp16_run, 2):
        assert skipped >= 7  # 2^20 down to 2^12 or below
        assert scales[skipped - 1] < 2.0**20
        assert max(scales[skipped:]) > min(scales)  # it grows again after good steps
        assert all(math.isfinite(v) for v in losses)
        assert losses[-1] < losses[0] - 1.0  # and it trains


def test_a_float16_gradient_with_a_norm_beyond_float16_is_no_overflow():
    """Every entry finite, the norm 1e5 > 65504 (float16's largest): a finite norm, so the
    step is taken; an inf entry still makes it inf (the overflow that skips a step)."""
    from paratrain.parallel.data_parallel.grad_lists import squared_norms

    big = torch.full((10_000,), 1000.0, dtype=torch.float16)
    squares = squared_norms([big, torch.ones(4), big[:4]], torch.device("cpu"))
    # 10,000 float32 additions: within their bound n * 2**-24 of the exact 1e10
    assert math.isclose(squares[0].item(), 1e10, rel_tol=10_000 * 2.0**-24)
    assert squares[1:].tolist() == [4.0, 4e6]  # small sums of integers: exact
    big[7] = float("inf")
    assert squared_norms([big], torch.device("cpu")).isinf().all()


def test_dynamic_loss_scaler_halves_on_overflow_and_doubles_after_good_steps():
    scaler = DynamicLossScaler(initial=1024.0, growth_interval=3)
    scaler.update(found_inf=True)
    assert scaler.scale == 512.0 and scaler.skipped == 1
    for _ in range(3):
        scaler.update(found_inf=False)
    assert scaler.scale == 1024.0


def test_scale_backward_scales_the_gradient_not_the_value():
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    y = scale_backward(x * 3, 8.0)
    assert torch.equal(y, torch.tensor([3.0, 6.0]))
    y.sum().backward()
    assert torch.equal(x.grad, torch.tensor([24.0, 24.0]))


def test_precision_policy():
    bf16 = MixedPrecision.of("bf16")
    assert bf16.has_master and not bf16.needs_loss_scaling
    assert (bf16.param_bytes, bf16.reduce_bytes) == (2, 4)
    assert not MixedPrecision().has_master
    assert MixedPrecision.of("fp16").needs_loss_scaling
    assert parse_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="valid"):
        MixedPrecision.of("int8")


def fp16_training(rank, world_size, dtype, loss_scale=2.0**16, steps=16):
    from paratrain.train.loop import train

    cfg = tiny_config(steps=steps, micro_batch=4, dtype=dtype, loss_scale=loss_scale)
    cfg.parallel.dp, cfg.parallel.zero = world_size, 1
    result = train(cfg, Mesh.build(dp=world_size), tiny_data())
    return [(m.loss, m.skipped) for m in result.metrics], result.engine.replicas[0].scaler


def test_fp16_training_with_loss_scaling_tracks_fp32():
    """`train --dtype float16` with a loss scale that fits (2^4: the loop multiplies each
    micro-batch's loss by its token count, so the gradients are already large) ends within
    0.15 nats of the fp32 run (measured: 0.08; fp16 keeps 11 bits of mantissa)."""
    fp32 = run_distributed(fp16_training, 2, "float32")[0][0]
    steps, scaler = run_distributed(fp16_training, 2, "float16", 2.0**4)[0]
    assert scaler.skipped == 0 and not any(skipped for _, skipped in steps)
    assert abs(steps[-1][0] - fp32[-1][0]) < 0.15, (steps[-1][0], fp32[-1][0])


def test_fp16_overflows_are_left_to_the_loss_scaler_not_counted_as_faults():
    """At the default 2^16 the first steps overflow: each is skipped and the scale halved,
    more times in a row than max_skipped_steps (3) allows for NaNs, and the run goes on."""
    steps, scaler = run_distributed(fp16_training, 2, "float16", 2.0**16, 12)[0]
    skipped = [s for _, s in steps]
    assert scaler.skipped == sum(skipped) > 3 and skipped[:4] == [True] * 4
    assert scaler.scale < 2.0**16
    losses = [loss for loss, s in steps if not s]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]


def bf16_pipeline(rank, world_size, data):
    from paratrain.train.loop import train

    cfg = tiny_config(micro_batch=2, dtype="bfloat16")
    cfg.parallel.pp, cfg.parallel.dp = world_size, 1
    cfg.train.microbatches = cfg.train.global_batch // cfg.train.micro_batch
    result = train(cfg, Mesh.build(pp=world_size), data)
    return [m.loss for m in result.metrics], result.engine.runtime.dtype


def test_a_bf16_pipeline_sends_bf16_activations_and_tracks_fp32():
    # bf16 is the default on GPUs: stages must exchange activations in the compute dtype.
    data = tiny_data()
    reference, _ = reference_training(tiny_config(micro_batch=2), data)
    for losses, dtype in run_distributed(bf16_pipeline, 2, data):
        assert dtype == torch.bfloat16
        for a, b in zip(losses, reference.losses, strict=True):
            assert math.isclose(a, b, rel_tol=BF16_LOSS_RTOL), (a, b)
