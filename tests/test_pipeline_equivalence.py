"""Pipeline training equals single-process training on the whole batch, for every schedule.

S gloo processes each build the full GPT from the same seed, keep their chunks, and train a
few AdamW steps with the pipeline runtime; the reference (tests/equivalence.py) trains the
whole model on the whole global batch in one process. Both take each step's global batch
from the same stateless BatchSampler.

Exact in this setup: the data of each step and the initial weights. Equal to float32
rounding: losses, gradient norms and final parameters, because the pipeline sums K
micro-batch gradients (each weighted 1/K) where the reference averages over one big batch,
the same reordering as gradient accumulation (tolerances in equivalence.py). With K a
power of two the 1/K weight is exact; with K = 6 the gradient norm after three Adam steps
was measured 7.8e-6 off (relative), over the shared 2e-6 bound, although the first step's
gradients agree to 7e-7 of their largest entry: Adam amplifies rounding (equivalence.py).
So the training cases use K = 1, 2, 3, 4, 8, and the one-step gradient test below takes
K = 6 with all schedules, where it also checks that the schedules agree with each other
bit for bit: they add the same micro-batch gradients in the same order.
"""

from __future__ import annotations

import copy

import pytest
import torch

from paratrain.data.tokens import BatchSampler
from paratrain.mesh import Mesh
from paratrain.models.gpt import GPT, GPTConfig
from paratrain.models.plans import GPT_PLAN
from paratrain.parallel.pipeline import PipelineRuntime, build_schedule, split_into_stages
from paratrain.train.build import data_parallel, pipeline_plan
from paratrain.train.engine import PipelineEngine
from paratrain.train.optim import LrSchedule
from paratrain.train.step import train_step
from tests.distributed import run_distributed
from tests.equivalence import (
    RunRecord,
    assert_equivalent,
    reference_training,
    tiny_config,
    tiny_data,
)


def pipeline_config(num_stages: int, k: int, chunks: int, steps: int = 3):
    """tiny_config with one block per virtual stage and K micro-batches of 2 rows."""
    cfg = tiny_config(steps=steps, global_batch=2 * k, micro_batch=2)
    cfg.model.n_layer = num_stages * chunks
    return cfg


def build_stage(cfg, stage: int, num_stages: int, chunks: int) -> list[torch.nn.Module]:
    m = cfg.model
    torch.manual_seed(cfg.train.seed)  # the reference's seed: identical full model
    model = GPT(GPTConfig(m.vocab_size, m.n_layer, m.n_head, m.d_model, m.max_seq_len))
    return split_into_stages(model, stage, num_stages, chunks, plan=pipeline_plan(GPT_PLAN))


def train_pipeline(rank, world_size, cfg, data, schedule_name, chunks):
    """One pp rank: the one training step (train/step.py) over this stage's chunks."""
    mesh = Mesh.build(pp=world_size)
    group = mesh.group("pp")
    t = cfg.train
    k = t.global_batch // t.micro_batch
    stage_chunks = build_stage(cfg, group.rank, world_size, chunks)
    schedule = build_schedule(schedule_name, world_size, k, chunks)
    runtime = PipelineRuntime(stage_chunks, schedule, group, cfg.model.d_model)
    replicas = [data_parallel(c, mesh.group("dp"), cfg, reduce_op="avg") for c in stage_chunks]
    engine = PipelineEngine(replicas, runtime, mesh.group("tp"))
    opt = engine.build_optimizer(t.lr, t.weight_decay, (t.beta1, t.beta2))
    sampler = BatchSampler(data.train, t.seq_len, t.global_batch, t.seed)
    lr = LrSchedule.of(cfg)
    losses, norms = [], []
    for step in range(t.steps):
        micro = list(sampler.global_batch_at(step).split(t.micro_batch))
        out = train_step(engine, opt, micro, lr(step), t.grad_clip)
        losses.append(out.loss)
        norms.append(out.grad_norm)
    state = {}
    for chunk in stage_chunks:
        state.update(copy.deepcopy(chunk.state_dict()))
    mesh.close()
    return RunRecord(losses, norms, state)


def gathered(records: list[RunRecord]) -> RunRecord:
    """Every stage's parameters in one state dict; losses and norms agree on all stages."""
    state: dict[str, torch.Tensor] = {}
    for r in records:
        overlap = state.keys() & r.state.keys()
        assert not overlap, f"parameters on two stages: {sorted(overlap)[:3]}"
        state.update(r.state)
    for r in records[1:]:
        assert r.losses == records[0].losses and r.grad_norms == records[0].grad_norms
    return RunRecord(records[0].losses, records[0].grad_norms, state)


def train_cases(rank, world_size, cases, data):
    """Several cases in one set of processes: start-up and the first AdamW (which imports
    torch._dynamo, seconds on these cores) are paid once per rank, not once per case."""
    return [train_pipeline(rank, world_size, cfg, data, name, v) for name, cfg, v in cases]


# (schedule, K, v) per S: K < S, K = S and K > S where the schedule allows it.
CASES = {
    2: [("gpipe", 1, 1), ("gpipe", 4, 1), ("1f1b", 1, 1), ("1f1b", 3, 1), ("zb-h1", 4, 1),
        ("interleaved", 2, 2), ("interleaved", 4, 2)],
    4: [("gpipe", 4, 1), ("1f1b", 2, 1), ("1f1b", 8, 1), ("zb-h1", 8, 1),
        ("interleaved", 4, 2)],
    1: [("1f1b", 2, 1), ("interleaved", 2, 2)],  # S = 1: no messages, chunks hand over locally
}  # fmt: skip


@pytest.mark.parametrize("num_stages", [1, pytest.param(2, marks=pytest.mark.equivalence), 4])
def test_pipeline_matches_single_process(num_stages):
    data = tiny_data()
    cases = [(name, pipeline_config(num_stages, k, v), v) for name, k, v in CASES[num_stages]]
    results = run_distributed(train_cases, num_stages, cases, data)
    for i, (name, cfg, v) in enumerate(cases):
        reference, initial = reference_training(cfg, data)
        k = cfg.train.global_batch // cfg.train.micro_batch
        try:
            assert_equivalent(gathered([records[i] for records in results]), reference, initial)
        except AssertionError as e:
            raise AssertionError(f"{name} S={num_stages} K={k} v={v}: {e}") from e


def one_step_gradients(rank, world_size, cfg, data, cases):
    """Gradients of one run_step per (schedule, v), on fresh copies of the same model."""
    mesh = Mesh.build(pp=world_size)
    group, t = mesh.group("pp"), cfg.train
    k = t.global_batch // t.micro_batch
    sampler = BatchSampler(data.train, t.seq_len, t.global_batch, t.seed)
    micro = list(sampler.global_batch_at(0).split(t.micro_batch))
    out = []
    for name, v in cases:
        chunks = build_stage(cfg, group.rank, world_size, v)
        runtime = PipelineRuntime(
            chunks, build_schedule(name, world_size, k, v), group, cfg.model.d_model
        )
        loss = runtime.run_step(micro)
        grads = {n: p.grad.clone() for c in chunks for n, p in c.named_parameters()}
        out.append((loss, grads))
    mesh.close()
    return out


def test_one_step_gradients_equal_the_whole_batch_for_every_schedule():
    """K = 6 on S = 2: every parameter gets its gradient from all six micro-batches."""
    cfg = pipeline_config(2, 6, 2)  # four blocks: 2 per stage, or 1 per chunk with v = 2
    data = tiny_data()
    cases = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2)]
    results = run_distributed(one_step_gradients, 2, cfg, data, cases)
    m, t = cfg.model, cfg.train
    torch.manual_seed(t.seed)
    model = GPT(GPTConfig(m.vocab_size, m.n_layer, m.n_head, m.d_model, m.max_seq_len))
    batch = BatchSampler(data.train, t.seq_len, t.global_batch, t.seed).global_batch_at(0)
    ref_loss = model(batch[:, :-1], batch[:, 1:])
    ref_loss.backward()
    reference = {n: p.grad for n, p in model.named_parameters()}
    per_case = []
    for i, (name, _) in enumerate(cases):
        grads = {n: g for stage in results for n, g in stage[i][1].items()}
        assert grads.keys() == reference.keys(), name
        for n, ref in reference.items():
            err = ((grads[n] - ref).abs().max() / ref.abs().max()).item()
            assert err < 2e-6, f"{name}: gradient of {n} off by {err:.2g} of its largest entry"
        assert abs(results[-1][i][0] - ref_loss.item()) < 2e-6 * ref_loss.item(), name
        per_case.append(grads)
    for name, grads in zip(cases[1:3], per_case[1:3], strict=True):  # same split as gpipe
        for n, g in grads.items():
            assert torch.equal(g, per_case[0][n]), f"{name[0]} differs from gpipe in {n}"
