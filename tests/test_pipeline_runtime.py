"""The runtime beyond equivalence: evaluation, traffic, recorded timeline, memory, errors.

All in one set of gloo processes per pipeline depth, to pay start-up once.
"""

from __future__ import annotations

import pytest
import torch

from paratrain.comm import CommOptions
from paratrain.data.tokens import BatchSampler, validation_batches
from paratrain.mesh import Mesh
from paratrain.parallel.pipeline import PipelineRuntime, build_schedule
from paratrain.parallel.pipeline.schedules import COMPUTE, SEND_B, SEND_F
from tests.distributed import run_distributed
from tests.equivalence import tiny_data
from tests.test_pipeline_equivalence import build_stage, pipeline_config


def probe(rank, world_size, cfg, data, cases):
    """Per case: validation loss, bytes and messages sent, trace facts, peak in-flight."""
    mesh = Mesh.build(pp=world_size)
    group, t = mesh.group("pp"), cfg.train
    val = validation_batches(data.val, t.seq_len, t.micro_batch, 3)
    out = []
    for name, k, v in cases:
        chunks = build_stage(cfg, group.rank, world_size, v)
        schedule = build_schedule(name, world_size, k, v)
        runtime = PipelineRuntime(chunks, schedule, group, cfg.model.d_model)
        sampler = BatchSampler(data.train, t.seq_len, t.micro_batch * k, t.seed)
        mesh.ledger.reset()
        runtime.run_step(list(sampler.global_batch_at(0).split(t.micro_batch)))
        sent = mesh.ledger.totals().get(("pp", "send"))
        trace = runtime.last_trace
        kinds = [e.action.kind for e in trace.events]
        ok_times = all(trace.start <= e.start <= e.end <= trace.end for e in trace.events)
        val_loss = runtime.run_forward(val)
        with pytest.raises(ValueError, match=f"built for K={k}"):
            runtime.run_step([val[0]] * (k + 1))
        out.append(
            {
                "val_loss": val_loss,
                "bytes": sent.bytes_sent if sent else 0,
                "messages": sent.messages if sent else 0,
                "sends": sum(kind in (SEND_F, SEND_B) for kind in kinds),
                "computes": sum(kind in COMPUTE for kind in kinds),
                "times_ordered": ok_times,
                "bubble": trace.bubble_fraction(),
                "peak": trace.peak_in_flight,
            }
        )
    mesh.close()
    return out


def reference_val_loss(cfg, data) -> float:
    t = cfg.train
    chunks = build_stage(cfg, 0, 1, 1)  # the whole model as one piece
    model = chunks[0].eval()
    val = validation_batches(data.val, t.seq_len, t.micro_batch, 3)
    with torch.no_grad():
        return sum(model(b[:, :-1], b[:, 1:]).item() for b in val) / len(val)


@pytest.mark.parametrize("num_stages", [2, 4])
def test_runtime_traffic_trace_memory_and_evaluation(num_stages):
    cases = [("gpipe", 4, 1), ("1f1b", 8, 1), ("zb-h1", 4, 1), ("interleaved", 4, 2)]
    cfg = pipeline_config(num_stages, 4, 2)  # 2 blocks per stage: fits v = 1 and v = 2
    data = tiny_data()
    results = run_distributed(probe, num_stages, cfg, data, cases)
    t, c = cfg.train, cfg.model
    message = t.micro_batch * t.seq_len * c.d_model * 4  # b * T * C float32
    ref_val = reference_val_loss(cfg, data)
    for i, (name, k, v) in enumerate(cases):
        for stage, per_case in enumerate(results):
            r = per_case[i]
            where = f"{name} K={k} v={v} stage {stage}"
            assert r["val_loss"] == pytest.approx(ref_val, rel=1e-6), where
            # Activations out and gradients back: v chunk boundaries per stage, except
            # that nothing leaves the model's ends (first stage's chunk 0 sends no
            # gradient, last stage's last chunk no activation).
            links = 2 * v - (stage == 0) - (stage == num_stages - 1)
            assert r["sends"] == r["messages"] == links * k, where
            assert r["bytes"] == links * k * message, where
            per_unit = 3 if name == "zb-h1" else 2
            assert r["computes"] == per_unit * k * v and r["times_ordered"], where
            assert 0.0 <= r["bubble"] < 1.0, where
            if name == "gpipe":
                assert r["peak"] == k, where
            if name == "1f1b":
                assert r["peak"] == min(num_stages - stage, k), where


def step_under_each_order(rank, world_size, cfg, data, cases):
    """Per order and case: the step's loss and this stage's gradients, after one step."""
    out = {}
    for order in ("gloo", "nccl"):
        mesh = Mesh.build(pp=world_size, options=CommOptions(order=order, timeout_s=60))
        group, t = mesh.group("pp"), cfg.train
        for name, k, v in cases:
            chunks = build_stage(cfg, group.rank, world_size, v)
            runtime = PipelineRuntime(chunks, build_schedule(name, world_size, k, v), group, 32)
            sampler = BatchSampler(data.train, t.seq_len, t.micro_batch * k, t.seed)
            loss = runtime.run_step(list(sampler.global_batch_at(0).split(t.micro_batch)))
            grads = [p.grad.clone() for p in runtime.parameters()]
            out[(order, name)] = (loss, grads)
        mesh.close()
    return out


@pytest.mark.parametrize("num_stages", [2, 4])
def test_every_schedule_runs_under_nccl_order_bitwise_as_under_gloo(num_stages):
    """Under NCCL's stream order (comm/ordering.py) the runtime as it was hung at pp 2
    (its receives posted ahead, issue 28); now every schedule gives the same loss and
    gradients, bit for bit, as under gloo's."""
    cases = [("gpipe", 4, 1), ("1f1b", 4, 1), ("zb-h1", 4, 1), ("interleaved", 4, 2)]
    cfg = pipeline_config(num_stages, 4, 2)
    assert cfg.model.d_model == 32
    for per_case in run_distributed(step_under_each_order, num_stages, cfg, tiny_data(), cases):
        for name, _, _ in cases:
            loss, grads = per_case[("gloo", name)]
            nccl_loss, nccl_grads = per_case[("nccl", name)]
            assert loss == nccl_loss, name
            assert all(torch.equal(a, b) for a, b in zip(grads, nccl_grads, strict=True)), name
