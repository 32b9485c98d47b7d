"""Context parallelism in training equals single-process training (float32).

One launch of 4 processes trains each layout through `paratrain.train.loop.train` (what
`paratrain train` runs) and compares with plain PyTorch on one process
(tests/equivalence.py's reference and `assert_layout_equivalent`): every step's loss and
gradient norm, and every final parameter, within the reference's tolerance, derived on
the machine that runs the test from float32 against float64 (`Tolerance`). The layouts:
GPT and Llama (rotary positions, grouped-query attention), ring and all-to-all attention,
cp 2 with dp 2 (ZeRO 0-3), with tp 2 (and sequence parallelism), with pp 2, and cp 4.
Not exact: ring attention merges blocks by the log-sum-exp rule, all-to-all attention
and the dp_cp reduction reorder the sums, so results differ by rounding (measured:
losses within 1.4e-7 relative, gradient norms within 2.9e-7, parameters within 1.3e-5
(2.7e-6 for Llama); derived on an AMD EPYC: 3.8e-6, 3.8e-6, and 9.5e-6 (Llama) to
7.7e-5 (GPT)).

The same launch measures activation memory with saved-tensor hooks at cp 1, 2 and 4.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from paratrain import checkpoint
from paratrain.checkpoint.whole_model import read_model
from paratrain.config.toml_file import from_toml_text
from paratrain.data.tokens import load_tokens, validation_batches
from paratrain.models.registry import plain_model
from paratrain.validate import resolve_and_check
from tests.distributed import run_distributed
from tests.equivalence import (
    References,
    assert_layout_equivalent,
    reference_training,
    tiny_config,
    tiny_data,
    train_layouts,
)
from tests.test_mode_pairs import LLAMA
from tests.test_train_cli import last_json, losses, paratrain

CLIP = 0.5  # below every norm of these runs (about 1.6 to 5): clipping is active

# Each layout on 4 processes: the model, then [parallel] and [train] fields. The
# combination grid (scripts/combination_coverage.py) names the modes each one trains.
LAYOUTS = [
    ("gpt", {"cp": 2, "dp": 2, "comm_algo": "tree"}, {"recompute": "full"}),
    ("gpt", {"cp": 2, "dp": 2, "zero": 3}, {}),
    ("gpt", {"cp": 2, "dp": 2, "zero": 2}, {}),
    ("llama", {"cp": 2, "dp": 2, "zero": 1}, {}),
    ("gpt", {"cp": 2, "cp_method": "alltoall", "dp": 2}, {}),
    ("gpt", {"cp": 2, "tp": 2}, {}),
    ("llama", {"cp": 2, "cp_method": "alltoall", "dp": 2, "zero": 2, "comm_algo": "ring"},
     {"recompute": "selective"}),
    ("llama", {"cp": 2, "tp": 2, "sequence_parallel": True}, {}),
    ("gpt", {"cp": 2, "cp_method": "alltoall", "tp": 2, "comm_algo": "tree"},
     {"recompute": "full"}),
    ("gpt", {"cp": 2, "pp": 2, "comm_algo": "ring"}, {"recompute": "selective"}),
    ("gpt", {"cp": 4, "cp_method": "alltoall"}, {}),
    # Every schedule with each method: stages pass sequence-sharded activations.
    ("gpt", {"cp": 2, "pp": 2, "schedule": "gpipe"}, {}),
    ("gpt", {"cp": 2, "pp": 2, "schedule": "zb-h1"}, {}),
    ("gpt", {"cp": 2, "cp_method": "alltoall", "pp": 2, "zero": 1}, {}),
    ("gpt", {"cp": 2, "cp_method": "alltoall", "pp": 2, "schedule": "gpipe"}, {}),
    ("gpt", {"cp": 2, "cp_method": "alltoall", "pp": 2, "schedule": "zb-h1"}, {}),
    ("gpt", {"cp": 2, "cp_method": "alltoall", "dp": 2, "zero": 3}, {}),
    ("gpt", {"cp": 2, "cp_method": "alltoall", "tp": 2, "sequence_parallel": True}, {}),
    ("gpt", {"cp": 2, "pp": 2, "schedule": "interleaved", "chunks": 2}, {}),
    ("gpt", {"cp": 2, "cp_method": "alltoall", "pp": 2, "schedule": "interleaved",
             "chunks": 2}, {}),
]  # fmt: skip
# The three axes at once, on 8 processes (one launch of its own: 8 ranks on 2 cores).
LAYOUTS_8 = [
    ("gpt", {"cp": 2, "dp": 2, "tp": 2, "sequence_parallel": True}, {}),
    ("gpt", {"cp": 2, "tp": 2, "pp": 2}, {}),  # 1F1B
]


def layout_config(arch: str, parallel: dict, train: dict, world: int = 4):
    cfg = tiny_config(micro_batch=2, grad_clip=CLIP, **train)
    cfg.model.n_head = 4  # tp 2 x alltoall cp 2, and alltoall cp 4, need 4 heads
    if arch == "llama":  # 4 query heads, 2 key/value heads
        cfg.model = dataclasses.replace(cfg.model, **{**LLAMA, "n_layer": 2, "ffn_hidden": 48})
    cfg.parallel = dataclasses.replace(cfg.parallel, **parallel)
    p = cfg.parallel
    cfg.model.n_layer = max(cfg.model.n_layer, p.pp * p.chunks)  # a block per piece
    p.nproc = max(p.dp, 1) * p.tp * p.pp * p.cp
    assert p.nproc == world
    cfg.train.microbatches = 0
    return resolve_and_check(cfg, p.nproc)


@pytest.mark.parametrize(
    ("heads", "kv", "cp", "method", "tp", "seq", "sp", "refused"),
    [
        (4, 2, 2, "ring", 1, 32, False, None),  # key/value heads need not divide for ring
        (4, 2, 2, "ring", 1, 30, False, "sequence length 30 must be divisible by 4"),
        (4, 2, 2, "alltoall", 1, 30, False, None),  # the plain layout: cp chunks
        (4, 2, 4, "alltoall", 1, 32, False, "2 key/value heads not divisible by 4"),
        (4, 4, 2, "alltoall", 2, 32, False, None),
        (4, 2, 2, "alltoall", 2, 32, False, "1 key/value heads not divisible by 2"),
        (4, 4, 2, "ring", 4, 36, True, "each rank's 18 tokens"),  # s/cp, then over tp
        (4, 2, 2, "ring", 2, 40, True, None),
    ],
)
def test_context_parallel_checks_name_the_sizes(heads, kv, cp, method, tp, seq, sp, refused):
    from paratrain.models.plans import check_context_parallel

    model = dataclasses.replace(tiny_config().model, n_head=heads, n_kv_head=kv)
    if refused is None:
        check_context_parallel(model, cp, method, tp, seq, sp)
    else:
        with pytest.raises(ValueError, match=refused):
            check_context_parallel(model, cp, method, tp, seq, sp)


def test_the_config_offers_the_methods_that_exist():
    from paratrain.config import CP_METHODS
    from paratrain.parallel.context_parallel import METHODS

    assert tuple(METHODS) == CP_METHODS


def cp_runs(rank, world_size, runs, data, memory_cfg):
    return train_layouts(rank, world_size, runs, data), activation_bytes(memory_cfg)


def activation_bytes(cfg) -> dict[int, int]:
    """Bytes this rank's forward saves for backward at cp 1, 2 and 4 (ring attention)."""
    from paratrain.data.tokens import BatchSampler
    from paratrain.measure.activations import ActivationMeter
    from paratrain.mesh import Mesh
    from paratrain.parallel.context_parallel import TokenShard, apply_context_parallel
    from paratrain.train.build import build_model, plan_of

    t, plan = cfg.train, plan_of(cfg)
    batch = BatchSampler(tiny_data().train, t.seq_len, t.micro_batch, t.seed).global_batch_at(0)
    out = {}
    for cp in (1, 2, 4):
        mesh = Mesh.build(dp=4 // cp, cp=cp)
        model = build_model(cfg)
        group = mesh.group("cp")
        if cp > 1:
            apply_context_parallel(
                model, plan.context_attention, plan.context_positions, group, "ring"
            )
        inputs, targets = TokenShard.of(group, "ring")(batch)
        with ActivationMeter(model) as meter:
            loss = model(inputs, targets)
        loss.backward()  # the ring's backward is collective: every rank runs it
        out[cp] = meter.total
    return out


def test_context_parallel_layouts_match_single_process():
    data = tiny_data()
    configs = [layout_config(*layout) for layout in LAYOUTS]
    runs = [(c.parallel.dp, c.parallel.pp, c.parallel.tp, c) for c in configs]
    memory_cfg = tiny_config(seq_len=64, micro_batch=2)
    memory_cfg.model.max_seq_len = 64
    per_rank = run_distributed(cp_runs, 4, runs, data, memory_cfg, timeout=600)
    check_layouts(LAYOUTS, configs, [records for records, _ in per_rank], data)
    check_activation_memory([memory for _, memory in per_rank])


def test_context_tensor_and_data_parallel_together_match_single_process():
    data = tiny_data()
    configs = [layout_config(*layout, world=8) for layout in LAYOUTS_8]
    runs = [(c.parallel.dp, c.parallel.pp, c.parallel.tp, c) for c in configs]
    per_rank = run_distributed(train_layouts, 8, runs, data, timeout=600)
    check_layouts(LAYOUTS_8, configs, per_rank, data)


def check_layouts(layouts: list, configs: list, per_rank: list[list], data) -> None:
    """Every layout's per-step losses and gradient norms, and its final parameters (the
    ranks' put together), against one process training the same data, within its derived
    tolerance; clipping active on every step, every rank reporting the same losses and
    norms, the parameters moved (tests/equivalence.py: assert_layout_equivalent)."""
    references = References(data)
    for i, (layout, cfg) in enumerate(zip(layouts, configs, strict=True)):
        try:
            assert_layout_equivalent([r[i] for r in per_rank], cfg, data, CLIP, references)
        except AssertionError as e:
            e.add_note(f"layout {layout}")
            raise


def check_activation_memory(per_rank: list[dict[int, int]]) -> None:
    """Per rank within 10% of 1/cp of the cp 1 figure (see docs/context-parallel.md)."""
    whole = per_rank[0][1]
    for cp in (2, 4):
        for memory in per_rank:
            assert abs(memory[cp] * cp / whole - 1) <= 0.10, (cp, memory[cp], whole)


@pytest.mark.e2e
@pytest.mark.equivalence  # the launcher's torch API too: it broke on 2.11 once (compat.py)
def test_paratrain_train_cp_2_matches_single_process(tmp_path):
    """`paratrain train --cp 2` through the launcher, Llama (rotary positions, grouped-query
    attention), ring attention by default: the run's step losses, its validation loss and
    its checkpointed weights against plain PyTorch on the same data and seed."""
    text, out = tmp_path / "data.txt", tmp_path / "run"
    text.write_bytes(Path(json.__file__).read_bytes() * 2)
    small = ["--model", "llama-tiny", "--n-layer", "2", "--d-model", "32", "--ffn-hidden", "48"]
    small += ["--seq-len", "16", "--global-batch", "4", "--micro-batch", "2", "--steps", "3"]
    small += ["--lr", "0.01", "--warmup-steps", "2", "--val-batches", "2"]
    proc = paratrain(
        "train", "--cp", "2", "--nproc", "2", *small, "--data", str(text), "--json",
        "--out", str(out), cwd=tmp_path,
    )  # fmt: skip
    cfg = from_toml_text((out / "config.toml").read_text())
    assert (cfg.parallel.cp, cfg.parallel.cp_method, cfg.parallel.dp) == (2, "ring", 1)
    data = load_tokens(str(text), cfg.data.val_fraction)
    reference, _ = reference_training(cfg, data)
    tol = reference.tolerance
    for a, b in zip(losses(out), reference.losses, strict=True):
        assert math.isclose(a, b, rel_tol=tol.loss_rtol), (a, b)
    weights = read_model(checkpoint.latest_checkpoint(out).path)
    for name, ref in reference.state.items():
        assert (weights[name] - ref).abs().max().item() <= tol.param_atol, name
    model = plain_model(cfg.model)
    model.load_state_dict(reference.state)
    t = cfg.train
    batches = validation_batches(data.val, t.seq_len, t.micro_batch, t.val_batches)
    with torch.no_grad():
        val = sum(model(b[:, :-1], b[:, 1:]).item() for b in batches) / len(batches)
    # The validation loss is the loss of the same two trajectories one step on: its tolerance.
    assert math.isclose(last_json(proc)["val_loss"], val, rel_tol=tol.loss_rtol)
