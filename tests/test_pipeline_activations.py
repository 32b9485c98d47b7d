"""In-flight activation bytes, measured by the runtime with saved-tensor hooks.

The schedule predicts how many (micro-batch, chunk) forwards a stage holds at once (GPipe
K, 1F1B S - stage); here the runtime's own byte count, taken from the tensors autograd
saved, must agree. The micro-batches are cloned so that no two share a storage (slices of
one batch tensor would share its token ids, which the runtime counts once); with equal
shapes every forward of a stage then saves the same bytes, so the peaks are exact
multiples of one micro-batch's bytes.
"""

from __future__ import annotations

from paratrain.data.tokens import BatchSampler
from paratrain.measure.activations import ActivationMeter
from paratrain.mesh import Mesh
from paratrain.parallel.pipeline import PipelineRuntime, build_schedule
from tests.distributed import run_distributed
from tests.equivalence import tiny_data
from tests.test_pipeline_equivalence import build_stage, pipeline_config


def measure(rank, world_size, cfg, data, cases, meter=True):
    mesh = Mesh.build(pp=world_size)
    group, t = mesh.group("pp"), cfg.train
    out = []
    for name, k in cases:
        chunks = build_stage(cfg, group.rank, world_size, 1)
        schedule = build_schedule(name, world_size, k, 1)
        runtime = PipelineRuntime(
            chunks, schedule, group, 32, meter=ActivationMeter if meter else None
        )
        sampler = BatchSampler(data.train, t.seq_len, t.micro_batch * k, t.seed)
        micro = [m.clone() for m in sampler.global_batch_at(0).split(t.micro_batch)]
        runtime.run_step(micro)
        trace = runtime.last_train_trace
        runtime.run_forward(micro[:1])  # evaluation replaces last_trace only
        assert runtime.last_train_trace is trace and runtime.last_trace is not trace
        out.append(
            {
                "per_micro": sorted(set(trace.activation_bytes.values())),
                "forwards": len(trace.activation_bytes),
                "peak_bytes": trace.peak_in_flight_bytes,
                "peak": trace.peak_in_flight,
            }
        )
    mesh.close()
    return out


def test_peak_in_flight_bytes_gpipe_k_and_1f1b_s_minus_stage():
    num_stages, cases = 2, [("gpipe", 4), ("1f1b", 4)]
    cfg = pipeline_config(num_stages, 4, 1)
    results = run_distributed(measure, num_stages, cfg, tiny_data(), cases)
    for i, (name, k) in enumerate(cases):
        for stage, per_case in enumerate(results):
            r, where = per_case[i], f"{name} K={k} stage {stage}"
            assert r["forwards"] == k, where
            (one,) = r["per_micro"]  # equal shapes: every forward saves the same bytes
            assert one > 0, where
            held = k if name == "gpipe" else min(num_stages - stage, k)
            assert r["peak"] == held, where
            assert r["peak_bytes"] == held * one, where


def test_without_the_meter_nothing_is_counted_and_the_schedule_is_the_same():
    cfg = pipeline_config(2, 4, 1)
    results = run_distributed(measure, 2, cfg, tiny_data(), [("1f1b", 4)], False)
    for stage, (r,) in enumerate(results):
        assert r["per_micro"] == [0] and r["peak_bytes"] == 0, stage
        assert r["forwards"] == 4 and r["peak"] == 2 - stage, stage
