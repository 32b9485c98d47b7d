"""Mixture of experts in training: `paratrain train --model moe-tiny --ep 2` from the CLI
(alone, at dp 4 with ZeRO-1, with tp 2, in a pipeline), and expert parallelism composed
with ZeRO-1/2/3, buckets, tensor parallelism and pipelines (1F1B, GPipe, ZB-H1), against plain
single-process training (tests/equivalence.py's reference, float32) on the same data and
seed; and dp 4 x ep 2 with ZeRO-1 in bfloat16, within test_mixed_precision.py's bf16
bounds of it (measured: losses 4.3e-3 relative, the update 0.11 of its norm).

Every step's batch is one micro-batch per replica (K = 1), so the batch the router sees,
over the data-parallel ranks (train/experts.py), is the reference's whole batch: capacity
(moe-tiny drops a few percent of the assignments), the queues and the auxiliary loss
are the same numbers, added in another order. Clipping is active on every step (norms
about 2.5 to 3.5, clip 1), so the gradient norm, which must count each expert once
whatever the layout, reaches the parameters. Tolerances: losses 1e-5 relative,
gradient norms 2e-5 relative, parameters 1e-4 absolute. Measured: losses and norms within
2.5e-7; parameters within 4.2e-5 in the in-process layouts (lr 5e-3: Adam moves a
weight whose gradient is near zero by up to lr whatever its rounding; at lr 1e-2 an
expert weight of the layouts came within 8.5e-5 of the bound, and one of dp 2 x tp 2 x
ep 2 from the CLI 1.03e-4 past it).
"""

from __future__ import annotations

import dataclasses
import json
import math
import textwrap

import pytest

from paratrain.config import RunConfig
from paratrain.config_toml import from_toml_text
from paratrain.models.presets import preset
from paratrain.train.checkpoint import latest_checkpoint
from paratrain.train.checkpoint_model import read_model
from paratrain.train.data import load_tokens
from paratrain.validate import resolve
from tests.distributed import run_distributed
from tests.equivalence import RunRecord, reference_training
from tests.test_mixed_precision import BF16_LOSS_RTOL, BF16_UPDATE_RTOL, update
from tests.test_train_cli import paratrain

LOSS_RTOL, NORM_RTOL, PARAM_ATOL = 1e-5, 2e-5, 1e-4
DATA = textwrap.__file__  # about 20 KB of text, split 95/5 by load_tokens


def assert_matches(run: RunRecord, reference: RunRecord, initial: dict) -> None:
    for step, (a, b) in enumerate(zip(run.losses, reference.losses, strict=True), start=1):
        assert math.isclose(a, b, rel_tol=LOSS_RTOL), f"step {step}: loss {a} != {b}"
    for step, (a, b) in enumerate(zip(run.grad_norms, reference.grad_norms, strict=True), 1):
        assert math.isclose(a, b, rel_tol=NORM_RTOL), f"step {step}: grad norm {a} != {b}"
        assert b > 1.0, "clipping must be active"
    assert run.state.keys() == reference.state.keys()
    for name, ref in reference.state.items():
        diff = (run.state[name] - ref).abs().max().item()
        assert diff <= PARAM_ATOL, f"{name} differs by {diff:.3g}"
    moved = max((ref - initial[n]).abs().max().item() for n, ref in reference.state.items())
    assert moved > 1e-3, "nothing was trained"


CLI_LAYOUTS = {  # name -> (flags, (dp, tp, pp, ep, zero)); one micro-batch per replica
    "ep 2": (["--nproc", "2", "--ep", "2"], (2, 1, 1, 2, 0)),
    "dp 4 x ep 2, ZeRO-1": (["--nproc", "4", "--ep", "2", "--zero", "1"], (4, 1, 1, 2, 1)),
    "dp 2 x tp 2 x ep 2": (["--nproc", "4", "--tp", "2", "--ep", "2"], (2, 2, 1, 2, 0)),
    "pp 2 x dp 2 x ep 2": (["--nproc", "4", "--pp", "2", "--ep", "2"], (2, 1, 2, 2, 0)),
}


@pytest.mark.e2e
@pytest.mark.parametrize("layout", CLI_LAYOUTS)
def test_moe_tiny_with_ep_2_from_the_cli_equals_one_process(tmp_path, layout):
    flags, expected = CLI_LAYOUTS[layout]
    out = tmp_path / "run"
    micro = str(8 // expected[0])
    # fmt: off
    proc = paratrain(
        "train", "--model", "moe-tiny", *flags, "--data", DATA,
        "--steps", "3", "--seq-len", "16", "--global-batch", "8", "--micro-batch", micro,
        "--lr", "5e-3", "--warmup-steps", "2", "--val-batches", "1", "--log-every", "1",
        "--out", str(out), cwd=tmp_path,
    )  # fmt: on
    cfg = from_toml_text((out / "config.toml").read_text())
    p = cfg.parallel
    assert (p.dp, p.tp, p.pp, p.ep, p.zero) == expected and cfg.model.num_experts == 4
    assert cfg.train.microbatches == 1
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    weights = read_model(latest_checkpoint(out).path)  # experts whole: (4, d, h)
    assert weights["blocks.0.mlp.experts.w_in"].shape == (4, 64, 256)
    run = RunRecord([r["loss"] for r in rows], [r["grad_norm"] for r in rows], weights)
    reference, initial = reference_training(cfg, load_tokens(DATA))
    # A checkpoint holds parameters: the routers' balancing biases (buffers, 0 here) not.
    buffers = {f"blocks.{i}.mlp.router.bias" for i in range(2)}
    assert reference.state.keys() - weights.keys() == buffers
    params = {k: v for k, v in reference.state.items() if k not in buffers}
    assert_matches(run, dataclasses.replace(reference, state=params), initial)
    # The routing is logged every step. Capacity: ceil(1.25 · k 2 · 128 tokens / 4) = 80
    # per layer and forward, so at most 80 per expert; the router starts unbalanced.
    for r in rows:
        assert 0 <= r["expert_tokens_min"] <= r["expert_tokens_max"] <= 80
        assert 0 < r["dropped_fraction"] < 1 and 0 < r["aux_loss"] < 0.1
    assert "experts: tokens per expert" in proc.stderr


LAYOUTS = {  # name -> (dp, tp, ep, zero, collective algorithms[, pp, schedule])
    "dp 4 x ep 2, ZeRO-1, ring": (4, 1, 2, 1, "ring"),
    "dp 4 x ep 2, ZeRO-2, tree": (4, 1, 2, 2, "tree"),
    "dp 4 x ep 2, buckets": (4, 1, 2, 0, "native"),
    # ZeRO-3: dense units over dp, each layer's experts a unit over expert_dp (its 2 ranks)
    "dp 4 x ep 2, ZeRO-3": (4, 1, 2, 3, "native"),
    "dp 2 x tp 2 x ep 2": (2, 2, 2, 0, "native"),
    "dp 4, experts whole (ep 1)": (4, 1, 1, 0, "native"),
    # Stage 0 holds block 0's router: its balancing loss rides on the stage's output.
    "pp 2 x dp 2 x ep 2, ZeRO-1, 1f1b": (2, 1, 2, 1, "native", 2, "1f1b"),
    "pp 2 x dp 2 x ep 2, ZeRO-2, gpipe": (2, 1, 2, 2, "native", 2, "gpipe"),
    "pp 2 x dp 2 x ep 2, zb-h1 (split backward)": (2, 1, 2, 0, "native", 2, "zb-h1"),
}
BF16 = (4, 1, 2, 1, "native")  # dp 4 x ep 2, ZeRO-1, in bfloat16: within bf16's bounds


def layout_config(
    dp: int,
    tp: int,
    ep: int,
    zero: int,
    algo: str,
    pp: int = 1,
    schedule: str = "1f1b",
    dtype: str = "float32",
) -> RunConfig:
    cfg = RunConfig()
    cfg.model = dataclasses.replace(cfg.model, **preset("moe-tiny"), name="moe-tiny")
    cfg.model.d_model, cfg.model.max_seq_len = 32, 32
    p, t = cfg.parallel, cfg.train
    p.nproc, p.dp, p.tp, p.ep, p.zero, p.bucket_mb = dp * tp * pp, dp, tp, ep, zero, 0.01
    p.pp, p.schedule = pp, schedule
    p.comm_algo = algo  # the run-wide default, as --comm-algo sets it
    t.seq_len, t.global_batch, t.micro_batch, t.steps = 16, 8, 8 // dp, 3
    t.dtype = dtype
    t.lr, t.warmup_steps, t.val_batches, t.grad_clip = 5e-3, 2, 1, 1.0
    return resolve(cfg, p.nproc)


def check_expert_shards(cfg: RunConfig, result, rank: int) -> None:
    """Under ZeRO-3 with ep > 1, what the rank holds at the step boundary: its experts'
    shard is 1/expert_dp of its E/ep experts (the wrapper's shards against the experts'
    sizes), and the model state by kind is the run's prediction (plan/rank_experts.py).
    The experts prefetch as the dense units do (--prefetch 1): layer 1's gather is issued
    before layer 0's forward ends, and layer 0's in layer 1's backward."""
    from paratrain.train.prediction import predict

    p = cfg.parallel
    if p.zero != 3 or p.ep == 1:
        return
    dense, experts = result.engine.replicas
    local = [q for n, q in result.engine.modules[0].named_parameters() if ".experts.local." in n]
    assert {id(q) for q in local} == {id(q) for u in experts.units for q in u.params}
    held = sum(s.param.numel() for s in experts.shards)  # no padding at d 32
    assert held * (p.dp // p.ep) == sum(q.numel() for q in local) > 0
    assert experts.group.size == p.dp // p.ep and dense.group.size == p.dp
    predicted = predict(cfg).model_state[rank]
    measured = result.extra["model_state_bytes"]
    assert measured == {k: v for k, v in predicted.items() if k != "total"}
    events = [e[:3] if e[0] == "gather" else e[:2] for e in experts.events]  # the last step's
    assert events.index(("gather", 1, "forward")) < events.index(("forward_end", 0))
    assert ("gather", 0, "backward") in events


def train_layouts(
    rank: int, world: int, configs: list[RunConfig], data, run_dirs: dict | None = None
) -> list[RunRecord]:
    """run_dirs: {config index: where it saves its checkpoint after the last step}."""
    from paratrain.comm import CommOptions
    from paratrain.mesh import Mesh
    from paratrain.parallel.expert_parallel import whole_experts
    from paratrain.parallel.tensor_parallel import full_state_dict
    from paratrain.train.loop import train

    records = []
    for i, cfg in enumerate(configs):
        p = cfg.parallel
        options = CommOptions(algo=p.comm_algo)
        mesh = Mesh.build(dp=p.dp, tp=p.tp, pp=p.pp, ep=p.ep, options=options)
        result = train(cfg, mesh, data, run_dir=(run_dirs or {}).get(i))
        check_expert_shards(cfg, result, rank)
        state = {}
        chunks = result.model if isinstance(result.model, list) else [result.model]
        for chunk in chunks:  # a pipeline stage may hold several
            whole = full_state_dict(chunk, mesh.group("tp"))
            state.update({k: v.float() for k, v in whole.items() if ".experts.local." not in k})
            state.update({k: v.float() for k, v in whole_experts(chunk).items()})
        losses = [m.loss for m in result.metrics]
        records.append(RunRecord(losses, [m.grad_norm for m in result.metrics], state))
    return records


def test_expert_parallel_with_zero_buckets_and_tp_equals_one_process(tmp_path):
    """At dp 4 x ep 2 each expert has two replicas (expert-dp [0 2] and [1 3]): the
    layout where reducing experts over the wrong group, or by the wrong factor, shows
    (docs/experts.md); with ZeRO-1/2 their shards live on the expert-dp group. Our ring
    and tree algorithms carry their layouts' reductions (all-to-alls stay native).
    Under ZeRO-3 each layer's experts are a unit of their own over expert-dp: the rank
    holds half its experts at the step boundary, as predicted (check_expert_shards).
    Broken on purpose: the experts' ZeRO-3 units over dp (step 1's loss: the wrapper's
    broadcast overwrites the other ranks' experts; the shard check first), and their
    reduce-scatter averaging instead of summing (step 1's gradient norm).
    At ep 1 the experts are whole on every rank and only the routing spans the ranks.
    Last, the bf16 layout, against the same float32 process.
    The ZeRO-3 layout saves a sharded checkpoint: `read_model` reads it back with whole
    experts, (E, d, h), equal to one process's parameters (the routers' balancing biases
    are buffers, which checkpoints do not hold)."""
    data = load_tokens(DATA)
    configs = [layout_config(*layout) for layout in LAYOUTS.values()]
    configs.append(layout_config(*BF16, dtype="bfloat16"))
    zero3 = list(LAYOUTS).index("dp 4 x ep 2, ZeRO-3")
    run_dirs = {zero3: tmp_path / "zero3"}
    per_rank = run_distributed(train_layouts, 4, configs, data, run_dirs, timeout=600)
    reference, initial = reference_training(configs[0], data)  # same model, data, seed
    saved = read_model(latest_checkpoint(run_dirs[zero3]).path)
    assert saved["blocks.0.mlp.experts.w_in"].shape == (4, 32, 128)
    buffers = {f"blocks.{i}.mlp.router.bias" for i in range(2)}
    assert reference.state.keys() - saved.keys() == buffers
    for name, value in saved.items():
        diff = (value.float() - reference.state[name]).abs().max().item()
        assert diff <= PARAM_ATOL, f"checkpoint: {name} differs by {diff:.3g}"
    for records in per_rank:  # bf16 against float32: test_mixed_precision.py's bounds
        bf16 = records[-1]
        for a, b in zip(bf16.losses, reference.losses, strict=True):
            assert math.isclose(a, b, rel_tol=BF16_LOSS_RTOL), (a, b)
        ours, ref = update(bf16.state, initial), update(reference.state, initial)
        assert (ours - ref).norm() <= BF16_UPDATE_RTOL * ref.norm()
    for i, (name, layout) in enumerate(LAYOUTS.items()):
        for rank, records in enumerate(per_rank):
            record = records[i]
            if len(layout) > 5:  # a pipeline: each rank holds its stage's parameters
                state = {k: v for r in per_rank for k, v in r[i].state.items()}
                record = dataclasses.replace(record, state=state)
            try:
                assert_matches(record, reference, initial)
            except AssertionError as e:
                e.add_note(f"layout {name}, rank {rank}")
                raise
