"""Mixture of experts in training: `paratrain train --model moe-tiny --ep 2` from the CLI
(alone, at dp 4 with ZeRO-1, with tp 2), and expert parallelism composed
with ZeRO-1/2/3, buckets, tensor parallelism and pipelines (1F1B, GPipe, ZB-H1), against plain
single-process training (tests/equivalence.py's reference, float32) on the same data and
seed; and dp 4 x ep 2 with ZeRO-1 in bfloat16, within test_mixed_precision.py's bf16
bounds of it (measured: losses 4.3e-3 relative, the update 0.11 of its norm). Last, the
routers' balancing bias (--bias-rate) in checkpoints: a resumed run goes on exactly.

Every step's batch is one micro-batch per replica (K = 1), so the batch the router sees,
over the data-parallel ranks (train/experts.py), is the reference's whole batch: capacity
(moe-tiny drops a few percent of the assignments), the queues and the auxiliary loss
are the same numbers, added in another order. Clipping is active on every step (norms
about 1.6 to 3.5, clip 1), so the gradient norm, which must count each expert once
whatever the layout, reaches the parameters.

Tolerances: tests/equivalence.py's, derived from float32 against float64, but from the
whole-batch order alone (`reference_training(..., orders=(1,))`): accumulating a step
over 2, 4 or 8 micro-batches is not a reordering here, capacity is per micro-batch, so
other assignments are dropped and the loss moves by 1e-4 relative, the norm by 3e-2 (a
different function, not rounding). With one float32 sample the loss and norm spreads
fall below the floor (8 float32 ulps, x SPREAD_FACTOR: 3.8e-6 relative); the parameters'
is 1.5e-5 (an expert weight: Adam moves a weight whose gradient is near zero by up to
lr whatever its rounding), so 1.2e-4 at lr 5e-3. Measured against it: losses and norms
within 2.5e-7, parameters within 4.2e-5.
"""

from __future__ import annotations

import dataclasses
import json
import math
import textwrap
from pathlib import Path

import pytest
import torch

from paratrain.checkpoint import latest_checkpoint
from paratrain.checkpoint.whole_model import read_model
from paratrain.cli import main
from paratrain.config import RunConfig
from paratrain.config.toml_file import from_toml_text
from paratrain.data.tokens import load_tokens
from paratrain.models.presets import preset
from paratrain.validate import resolve_and_check
from tests.distributed import run_distributed
from tests.equivalence import RunRecord, assert_equivalent, reference_training
from tests.test_mixed_precision import BF16_LOSS_RTOL, BF16_UPDATE_RTOL, update
from tests.test_train_cli import paratrain

DATA = textwrap.__file__  # about 20 KB of text, split 95/5 by load_tokens
WHOLE_BATCH = (1,)  # the only accumulation order that routes as our runs do (docstring)


def moe_reference(cfg: RunConfig, data) -> tuple[RunRecord, dict]:
    return reference_training(cfg, data, orders=WHOLE_BATCH)


def assert_matches(run: RunRecord, reference: RunRecord, initial: dict) -> None:
    assert all(b > 1.0 for b in reference.grad_norms), "clipping must be active"
    assert_equivalent(run, reference, initial)  # within reference.tolerance; it trained


CLI_LAYOUTS = {  # name -> (flags, (dp, tp, pp, ep, zero)); one micro-batch per replica
    "ep 2": (["--nproc", "2", "--ep", "2"], (2, 1, 1, 2, 0)),
    "dp 4 x ep 2, ZeRO-1": (["--nproc", "4", "--ep", "2", "--zero", "1"], (4, 1, 1, 2, 1)),
    "dp 2 x tp 2 x ep 2": (["--nproc", "4", "--tp", "2", "--ep", "2"], (2, 2, 1, 2, 0)),
}


def moe_cli_argv(flags: list[str], dp: int, out: Path) -> list[str]:
    return [
        "train", "--model", "moe-tiny", *flags, "--data", DATA,
        "--steps", "3", "--seq-len", "16", "--global-batch", "8", "--micro-batch", str(8 // dp),
        "--lr", "5e-3", "--warmup-steps", "2", "--val-batches", "1", "--log-every", "1",
        "--out", str(out),
    ]  # fmt: skip


@pytest.mark.parametrize("layout", ["dp 4 x ep 2, ZeRO-1", "dp 2 x tp 2 x ep 2"])
def test_the_cli_resolves_the_four_rank_expert_layouts(tmp_path, layout, capsys):
    """The 4-rank layouts train in-process (test_expert_parallel_with_zero_buckets_and_tp_
    equals_one_process, LAYOUTS); that the command line builds them is its dry run's."""
    flags, (dp, tp, pp, ep, zero) = CLI_LAYOUTS[layout]
    assert main([*moe_cli_argv(flags, dp, tmp_path / "run"), "--dry-run"]) == 0
    said = capsys.readouterr().out
    resolved = from_toml_text(said.split("\n# mesh:")[0])  # the resolved configuration
    p = resolved.parallel
    assert (p.dp, p.tp, p.pp, p.ep, p.zero) == (dp, tp, pp, ep, zero)
    assert resolved.train.microbatches == 1 and resolved.model.num_experts == 4


@pytest.mark.e2e
def test_moe_tiny_with_ep_2_from_the_cli_equals_one_process(tmp_path):
    flags, expected = CLI_LAYOUTS["ep 2"]
    out = tmp_path / "run"
    proc = paratrain(*moe_cli_argv(flags, expected[0], out), cwd=tmp_path)
    cfg = from_toml_text((out / "config.toml").read_text())
    p = cfg.parallel
    assert (p.dp, p.tp, p.pp, p.ep, p.zero) == expected and cfg.model.num_experts == 4
    assert cfg.train.microbatches == 1
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    weights = read_model(latest_checkpoint(out).path)  # experts whole: (4, d, h)
    assert weights["blocks.0.mlp.experts.w_in"].shape == (4, 64, 256)
    run = RunRecord([r["loss"] for r in rows], [r["grad_norm"] for r in rows], weights)
    reference, initial = moe_reference(cfg, load_tokens(DATA))
    # The checkpoint holds the routers' balancing biases beside the parameters (0 here).
    assert {f"blocks.{i}.mlp.router.bias" for i in range(2)} <= weights.keys()
    assert_matches(run, reference, initial)
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
    # Recomputation routes again in backward: the same gathers and all-to-alls, in order.
    "dp 4 x ep 2, ZeRO-2, recompute full": (4, 1, 2, 2, "native", 1, "1f1b", "float32", "full"),
    "pp 2 x dp 2 x ep 2, zb-h1, recompute selective": (
        2, 1, 2, 0, "native", 2, "zb-h1", "float32", "selective"),
}  # fmt: skip
HSDP = {  # --replicas 2: each replica group of 2 ranks holds every expert (ep 2 or 1)
    "HSDP 2 x (dp 2 x ep 2), ZeRO-1": (4, 1, 2, 1, "native"),
    "HSDP 2 x (dp 2 x ep 2), ZeRO-3": (4, 1, 2, 3, "native"),
    "HSDP 2 x dp 2, experts whole (ep 1), ZeRO-2": (4, 1, 1, 2, "native"),
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
    recompute: str = "none",
    replicas: int = 1,
) -> RunConfig:
    cfg = RunConfig()
    cfg.model = dataclasses.replace(cfg.model, **preset("moe-tiny"), name="moe-tiny")
    cfg.model.d_model, cfg.model.max_seq_len = 32, 32
    p, t = cfg.parallel, cfg.train
    p.nproc, p.dp, p.tp, p.ep, p.zero, p.bucket_mb = dp * tp * pp, dp, tp, ep, zero, 0.01
    p.pp, p.schedule, p.replicas = pp, schedule, replicas
    p.comm_algo = algo  # the run-wide default, as --comm-algo sets it
    t.seq_len, t.global_batch, t.micro_batch, t.steps = 16, 8, 8 // dp, 3
    t.dtype, t.recompute = dtype, recompute
    t.lr, t.warmup_steps, t.val_batches, t.grad_clip = 5e-3, 2, 1, 1.0
    return resolve_and_check(cfg, p.nproc)


def check_expert_shards(cfg: RunConfig, result, rank: int) -> None:
    """Under ZeRO-3 with ep > 1, what the rank holds at the step boundary: its experts'
    shard is 1/expert_dp of its E/ep experts, under HSDP 1/expert_shard (the wrapper's
    shards against the experts' sizes), and the model state by kind is the run's
    prediction (plan/rank_experts.py). The experts prefetch as the dense units do
    (--prefetch 1): layer 1's gather is issued before layer 0's forward ends, and layer
    0's in layer 1's backward."""
    from paratrain.train.prediction import predict

    p = cfg.parallel
    if p.zero != 3 or p.ep == 1:
        return
    dense, experts = result.engine.replicas
    local = [q for n, q in result.engine.modules[0].named_parameters() if ".experts.local." in n]
    assert {id(q) for q in local} == {id(q) for u in experts.units for q in u.params}
    held = sum(s.param.numel() for s in experts.shards)  # no padding at d 32
    shard_over = p.dp // (p.ep * p.replicas)  # HSDP: within a replica group (expert_shard)
    assert held * shard_over == sum(q.numel() for q in local) > 0
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
        mesh = Mesh.build(dp=p.dp, tp=p.tp, pp=p.pp, ep=p.ep, options=options, replicas=p.replicas)
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
    In 2 HSDP replica groups (ZeRO within each) the experts shard within their group and
    all-reduce across: skipping that all-reduce for them fails step 2's loss.
    Last, the bf16 layout, against the same float32 process.
    The ZeRO-3 layout saves a sharded checkpoint: `read_model` reads it back with whole
    experts, (E, d, h), equal to one process's parameters and the routers' balancing
    biases (persistent buffers: 0 here, bias_rate 0)."""
    data = load_tokens(DATA)
    configs = [layout_config(*layout) for layout in LAYOUTS.values()]
    configs += [layout_config(*layout, replicas=2) for layout in HSDP.values()]
    configs.append(layout_config(*BF16, dtype="bfloat16"))
    zero3 = list(LAYOUTS).index("dp 4 x ep 2, ZeRO-3")
    run_dirs = {zero3: tmp_path / "zero3"}
    per_rank = run_distributed(train_layouts, 4, configs, data, run_dirs, timeout=600)
    reference, initial = moe_reference(configs[0], data)  # same model, data, seed
    saved = read_model(latest_checkpoint(run_dirs[zero3]).path)
    assert saved["blocks.0.mlp.experts.w_in"].shape == (4, 32, 128)
    assert reference.state.keys() == saved.keys()  # the routers' biases too (buffers)
    for name, value in saved.items():
        diff = (value.float() - reference.state[name]).abs().max().item()
        assert diff <= reference.tolerance.param_atol, f"checkpoint: {name}: {diff:.3g}"
    for records in per_rank:  # bf16 against float32: test_mixed_precision.py's bounds
        bf16 = records[-1]
        for a, b in zip(bf16.losses, reference.losses, strict=True):
            assert math.isclose(a, b, rel_tol=BF16_LOSS_RTOL), (a, b)
        ours, ref = update(bf16.state, initial), update(reference.state, initial)
        assert (ours - ref).norm() <= BF16_UPDATE_RTOL * ref.norm()
    for i, (name, layout) in enumerate({**LAYOUTS, **HSDP}.items()):
        for rank, records in enumerate(per_rank):
            record = records[i]
            if len(layout) > 5 and layout[5] > 1:  # a pipeline: each rank its stage's
                state = {k: v for r in per_rank for k, v in r[i].state.items()}
                record = dataclasses.replace(record, state=state)
            try:
                assert_matches(record, reference, initial)
            except AssertionError as e:
                e.add_note(f"layout {name}, rank {rank}")
                raise


# DeepSeek-V3's balancing bias is a buffer that every step moves: a checkpoint holds it, so
# a stopped run resumes as the run that went on. Saved at step 2 of 4 at dp 2 x ep 2.
BIAS_STEPS, BIAS_SAVED, BIAS_RATE = 4, 2, 0.01
BIASES = [f"blocks.{i}.mlp.router.bias" for i in range(2)]
RESHARDED = {  # name -> layout_config's arguments; each resumes the dp 2 x ep 2 checkpoint
    "pp 2 x dp 2 x ep 2, ZeRO-1": (2, 1, 2, 1, "native", 2),  # each stage its own routers
    "dp 2 x tp 2 x ep 2": (2, 2, 2, 0, "native"),
    "dp 4 x ep 2 from a checkpoint without buffers": (4, 1, 2, 1, "native"),
}


def bias_config(*layout) -> RunConfig:
    cfg = layout_config(*layout)
    cfg.model.bias_rate = BIAS_RATE
    cfg.train.steps, cfg.train.checkpoint_every = BIAS_STEPS, BIAS_SAVED
    cfg.train.rewarmup_steps = 0  # resumed on 4 ranks: go on at the rate of the run on 2
    return cfg


def routers_at_start(engine) -> dict[str, list[float]]:
    return {
        f"{name}.bias": m.bias.tolist()
        for module in engine.modules
        for name, m in module.named_modules()
        if name.endswith("router")
    }


def run_and_resume(rank, world, runs, data, root):
    """runs: (cfg, directory, checkpoint to resume from or None); per run this rank's
    losses, gradient norms, routers' biases before the first step, and rank 0's warnings."""
    import logging
    from pathlib import Path

    from paratrain import checkpoint as ck
    from paratrain.mesh import Mesh
    from paratrain.train.loop import train

    warned: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("paratrain.checkpoint.load").addHandler(handler)
    out = []
    for cfg, where, source in runs:
        p, start = cfg.parallel, {}
        mesh = Mesh.build(dp=p.dp, tp=p.tp, pp=p.pp, ep=p.ep)
        saved = None
        if source is not None:
            saved = ck.Checkpoint(ck.checkpoint_path(Path(root) / source, BIAS_SAVED), BIAS_SAVED)
        warned.clear()
        result = train(cfg, mesh, data, run_dir=Path(root) / where, resume=saved,
                       on_start=lambda engine: start.update(routers_at_start(engine)))  # fmt: skip
        metrics = result.metrics
        out.append(([m.loss for m in metrics], [m.grad_norm for m in metrics], start, warned[:]))
    return out


def without_buffers(saved: Path, copy: Path) -> None:
    """A copy of a checkpoint as written before buffers were saved: its index without them
    (the bytes stay in the files, unreferenced)."""
    import pickle
    import shutil

    from paratrain.checkpoint.state import BUFFER

    shutil.copytree(saved, copy)
    with (copy / ".metadata").open("rb") as f:
        index = pickle.load(f)
    for key in [k for k in index.state_dict_metadata if k.startswith(BUFFER)]:
        del index.state_dict_metadata[key]
    index.storage_data = {
        i: where for i, where in index.storage_data.items() if not i.fqn.startswith(BUFFER)
    }
    with (copy / ".metadata").open("wb") as f:
        pickle.dump(index, f)


def test_the_balancing_bias_is_in_checkpoints_and_a_resumed_run_goes_on_exactly(tmp_path, caplog):
    """--bias-rate 0.01 at dp 2 x ep 2, resumed from the checkpoint of step 2 of 4 (what a
    stop by SIGTERM or --steps leaves): the resumed steps' losses and norms, the final
    parameters and biases are bitwise those of the run that went on. Resumed on other
    layouts (each pipeline stage holds its blocks' routers; tp ranks hold replicas), losses
    within the reference's tolerance of one process's (which balances the biases too) and
    the biases equal exactly (the update adds ±γ from integer loads).
    --init-from and export carry the bias; a checkpoint written before buffers were saved
    loads with the bias at 0 and one warning line."""
    from paratrain import checkpoint as ck
    from paratrain.checkpoint.whole_model import check_init_source
    from paratrain.train.build import build_model
    from paratrain.trained.safetensors_file import export_safetensors, load_exported
    from paratrain.validate.rules_experts import experts_rules

    data, cfg = load_tokens(DATA), bias_config(2, 1, 2, 0, "native")
    runs = [(cfg, "full", None), (cfg, "resumed", "full")]
    per_rank = run_distributed(run_and_resume, 2, runs, data, str(tmp_path), timeout=600)
    at_save = read_model(ck.checkpoint_path(tmp_path / "full", BIAS_SAVED))
    assert any(at_save[b].any() for b in BIASES), "the bias must have moved"
    final = read_model(ck.checkpoint_path(tmp_path / "full", BIAS_STEPS))
    for full, resumed in per_rank:  # same mesh: bitwise
        assert resumed[0] == full[0][BIAS_SAVED:] and resumed[1] == full[1][BIAS_SAVED:]
        assert resumed[2] == {b: at_save[b].tolist() for b in BIASES} and not resumed[3]
    ours = read_model(ck.checkpoint_path(tmp_path / "resumed", BIAS_STEPS))
    assert ours.keys() == final.keys() and set(BIASES) <= final.keys()
    assert all(ours[k].equal(final[k]) for k in final)
    assert not all(final[b].equal(at_save[b]) for b in BIASES)  # moved after the resume
    reference, _ = moe_reference(cfg, data)
    rtol = reference.tolerance.loss_rtol
    for a, b in zip(per_rank[0][0][0], reference.losses, strict=True):  # the run that went on
        assert math.isclose(a, b, rel_tol=rtol), (a, b)
    tail = reference.losses[BIAS_SAVED:]

    old = ck.checkpoint_path(tmp_path / "old", BIAS_SAVED)
    without_buffers(ck.checkpoint_path(tmp_path / "full", BIAS_SAVED), old)
    others = [(bias_config(*layout), name, "full") for name, layout in RESHARDED.items()]
    others[-1] = (others[-1][0], "old-resumed", "old")
    per_rank = run_distributed(run_and_resume, 4, others, data, str(tmp_path), timeout=600)
    expected = {b: at_save[b].tolist() for b in BIASES}
    for i, (_, name, _) in enumerate(others[:-1]):
        for a, b in zip(per_rank[0][i][0], tail, strict=True):
            assert math.isclose(a, b, rel_tol=rtol), (name, a, b)
        starts = [records[i][2] for records in per_rank]  # a pipeline stage: its blocks'
        assert all(start.items() <= expected.items() for start in starts), name
        assert {b for start in starts for b in start} == set(BIASES), name
        assert not any(records[i][3] for records in per_rank), name  # no warning
        theirs = read_model(ck.checkpoint_path(tmp_path / name, BIAS_STEPS))
        assert all(theirs[b].equal(final[b]) for b in BIASES), name
    for rank, records in enumerate(per_rank):  # the checkpoint without buffers
        _, _, start, warned = records[-1]
        assert start == {b: [0.0] * 4 for b in BIASES}
        assert len(warned) == (rank == 0), warned
    warned = per_rank[0][-1][3][0]
    assert "holds no value for blocks.0.mlp.router.bias, blocks.1.mlp.router.bias" in warned

    # --init-from and export carry the bias; a source without buffers is said once.
    def initial_biases(source: str) -> list[torch.Tensor]:
        train = dataclasses.replace(cfg.train, init_from=str(tmp_path / source))
        model = build_model(dataclasses.replace(cfg, train=train))
        return [model.get_buffer(b) for b in BIASES]

    assert all(a.equal(final[b]) for a, b in zip(initial_biases("full"), BIASES, strict=True))
    assert all(not a.any() for a in initial_biases("old"))
    exported = load_exported(export_safetensors(tmp_path / "full"))
    assert all(exported.get_buffer(b).equal(final[b]) for b in BIASES)
    check_init_source(str(tmp_path / "old"), cfg.model)
    assert "holds no value for blocks.0.mlp.router.bias" in caplog.text
    accepted = bias_config(2, 1, 2, 0, "native")  # refused before checkpoints held the bias
    accepted.train.resume = accepted.train.init_from = str(tmp_path / "full")
    accepted.parallel.max_restarts = 1
    experts_rules(accepted)
