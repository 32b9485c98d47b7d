"""Mode combinations that no other test trains together (docs/reliability.md's combination
table: scripts/combination_coverage.py names these tests for every pair of each layout's
modes), two to five modes in one layout.

A layout is written in the table's mode keys ("zero1 rc-sel llama ring"): ZeRO at dp 2,
tp 2, pp 2, recomputation, our ring or tree collectives as the run-wide default (as
`--comm-algo` sets them), the Llama model, bf16 or fp16. Each trains the 4-block model for
4 steps with clipping active on every step; shards and stages are put back together and
checked against plain single-process training (tests/equivalence.py's reference):
- float32, and async with one worker: per step loss and gradient norm, and at the end
  every parameter, within tests/equivalence.py's tolerances. Recomputation repeats the
  same ops on the same numbers; ring, tree, ZeRO and the pipeline add the same gradients
  in another order. Measured: losses within 1.1e-7 relative, parameters within 6.1e-6.
- bf16 and fp16: within tests/test_mixed_precision.py's bf16 bounds.
- resumed from a checkpoint in the middle: bitwise the run that went on.
Layouts of one world size share one set of processes, and one reference per model.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from paratrain.models.presets import preset
from paratrain.validate import resolve_and_check
from tests.distributed import run_distributed
from tests.equivalence import (
    References,
    assert_equivalent,
    check_layouts,
    record_of,
    tiny_config,
    tiny_data,
    train_layouts,
)
from tests.test_mixed_precision import BF16_LOSS_RTOL, BF16_UPDATE_RTOL, update

LLAMA = {**preset("llama-tiny"), "name": "llama-tiny", "n_layer": 4, "d_model": 32}
MODES = {  # the table's key -> (section of RunConfig, its fields)
    "dp": ("parallel", {"dp": 2}),
    "async": ("parallel", {"dp": 2, "dp_mode": "async"}),  # a server and one worker
    "zero1": ("parallel", {"dp": 2, "zero": 1}),
    "zero2": ("parallel", {"dp": 2, "zero": 2}),
    "zero3": ("parallel", {"dp": 2, "zero": 3}),
    "cp": ("parallel", {"cp": 2}),  # ring attention
    "cp-a2a": ("parallel", {"cp": 2, "cp_method": "alltoall"}),
    "tp": ("parallel", {"tp": 2}),
    "sp": ("parallel", {"tp": 2, "sequence_parallel": True}),
    "gpipe": ("parallel", {"pp": 2, "schedule": "gpipe"}),
    "1f1b": ("parallel", {"pp": 2, "schedule": "1f1b"}),
    "interleaved": ("parallel", {"pp": 2, "schedule": "interleaved", "chunks": 2}),
    "zb-h1": ("parallel", {"pp": 2, "schedule": "zb-h1"}),
    "ring": ("parallel", {"comm_algo": "ring"}),
    "tree": ("parallel", {"comm_algo": "tree"}),
    "buckets": ("parallel", {"bucket_mb": 0.01}),  # 10 KB: many gradient buckets
    "rc-full": ("train", {"recompute": "full"}),
    "rc-sel": ("train", {"recompute": "selective"}),
    "llama": ("model", {**LLAMA, "ffn_hidden": 48}),
    "bf16": ("train", {"dtype": "bfloat16"}),
    "fp16": ("train", {"dtype": "float16", "loss_scale": 2.0**4}),  # fits: no step skipped
}
LAYOUTS = {  # world size -> float32 layouts
    2: [
        "zero1 rc-sel llama ring",
        "zero2 rc-full llama tree",
        "sp tree",
        "gpipe rc-sel llama ring",
        "interleaved rc-full llama tree",
        "1f1b rc-sel ring",
        "1f1b tree",
    ],
    4: [
        "dp gpipe rc-full tree",
        "dp zb-h1 ring",
        "zero1 gpipe rc-full",
        "zero1 interleaved rc-sel ring",
        "zero1 zb-h1 rc-full tree",
        "zero2 gpipe rc-sel",
        "zero2 interleaved ring",
        "zero2 zb-h1 buckets",  # ZB-H1's weight pass: one ZeRO-2 flush per micro-batch
        "tp zb-h1 rc-sel ring",
        "zero3 sp rc-full llama ring",
        "zero3 tp rc-sel tree",
    ],
    8: ["dp tp gpipe", "dp tp zb-h1"],
}
LOW_PRECISION = {  # world size -> layouts in bf16 or fp16
    2: [
        "tp bf16 rc-sel ring",
        "sp bf16 rc-full llama tree",
        "gpipe bf16 llama",
        "interleaved bf16",
        "zb-h1 bf16",
        "dp fp16 rc-sel llama ring",
        "cp bf16 rc-sel llama",
        "cp-a2a fp16 tree",
        "cp fp16 ring",
        "cp-a2a bf16 llama",
    ],
    4: ["zero1 tp bf16", "tp 1f1b bf16", "zero3 sp fp16 ring", "zero2 tp fp16 rc-full llama tree"],
}
ASYNC = "async rc-sel llama"
# World 2. fp16 starts at a scale that overflows the first steps: the scale falls by
# half at each, and the resumed run must go on from the fallen scale (the checkpoint
# holds it), not from --loss-scale, or it skips steps the uninterrupted run applied.
RESUMED = ["gpipe rc-full tree bf16", "zb-h1 rc-sel", "dp fp16", "cp", "cp-a2a llama"]
OVERFLOWING_SCALE = 2.0**11
SAVED_AT = 2  # of tiny_config's 4 steps
CLIP = 0.5  # below the norms of these runs (about 1.6 to 5): clipping is active


def layout_config(layout: str):
    cfg = tiny_config(micro_batch=2, grad_clip=CLIP)
    cfg.model.n_layer = 4
    for mode in layout.split():
        section, fields = MODES[mode]
        setattr(cfg, section, dataclasses.replace(getattr(cfg, section), **fields))
    p = cfg.parallel
    p.nproc = max(p.dp, 1) * p.pp * p.cp * p.tp
    cfg.train.microbatches = 0
    return resolve_and_check(cfg, p.nproc)


@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.equivalence), 4, 8])
def test_mode_layouts_match_single_process(world):
    configs = [layout_config(layout) for layout in LAYOUTS[world]]
    assert all(c.world_size == world for c in configs)
    check_layouts(world, configs, CLIP)


@pytest.mark.parametrize("world", sorted(LOW_PRECISION))
def test_low_precision_layouts_track_float32(world):
    """bf16 and fp16 (fp32 master weights) against the float32 reference, within
    tests/test_mixed_precision.py's bf16 bounds: every step's loss within 1%, the whole
    update (final - initial parameters, as the model holds them: rounded to its dtype)
    within 15% of float32's in L2. Measured: losses within 0.5%, updates within 5.1%
    (fp16: 0.05% and 2.3%). fp16's loss scale fits, so no step is skipped (every norm
    finite)."""
    data = tiny_data()
    configs = [layout_config(layout) for layout in LOW_PRECISION[world]]
    runs = [(c.parallel.dp, c.parallel.pp, c.parallel.tp, c) for c in configs]
    per_rank = run_distributed(train_layouts, world, runs, data, timeout=600)
    references = References(data)
    for i, (layout, cfg) in enumerate(zip(LOW_PRECISION[world], configs, strict=True)):
        reference, initial = references(cfg)  # float32 whatever cfg's dtype
        state = {k: v.float() for records in per_rank for k, v in records[i].state.items()}
        record = per_rank[0][i]
        assert all(math.isfinite(n) for n in record.grad_norms), (layout, record.grad_norms)
        for a, b in zip(record.losses, reference.losses, strict=True):
            assert math.isclose(a, b, rel_tol=BF16_LOSS_RTOL), (layout, a, b)
        ours, ref = update(state, initial), update(reference.state, initial)
        error = ((ours - ref).norm() / ref.norm()).item()
        assert error <= BF16_UPDATE_RTOL, (layout, error)
        assert all(r[i].losses == record.losses for r in per_rank), layout


def async_run(rank, world_size, cfg, data):
    from paratrain.mesh import Mesh
    from paratrain.train.async_loop import train_async

    mesh = Mesh.build(dp=world_size)
    result = train_async(cfg, mesh, data)
    return record_of(result, mesh.group("tp")) if rank == 0 else None  # the server's


def test_one_worker_async_matches_single_process():
    """With one worker nothing races: it pushes each step's gradient of the whole global
    batch and the server applies it before answering, which is one process's step."""
    data, cfg = tiny_data(), layout_config(ASYNC)
    record = run_distributed(async_run, 2, cfg, data, timeout=600)[0]
    assert_equivalent(record, *References(data)(cfg))


def resumed_runs(rank, world_size, configs, data, run_dir):
    """Each layout's uninterrupted run (saving at SAVED_AT) and its run resumed from there,
    in another run directory; this rank's records of both."""
    from paratrain import checkpoint as ck
    from paratrain.comm import CommOptions
    from paratrain.mesh import Mesh
    from paratrain.train.loop import train

    out = []
    for i, cfg in enumerate(configs):
        p, where = cfg.parallel, Path(run_dir) / str(i)
        options = CommOptions(algo=p.comm_algo)
        mesh = Mesh.build(dp=p.dp, pp=p.pp, tp=p.tp, cp=p.cp, options=options)
        full = train(cfg, mesh, data, run_dir=where / "full")
        saved = ck.Checkpoint(ck.checkpoint_path(where / "full", SAVED_AT), SAVED_AT)
        resumed = train(cfg, mesh, data, run_dir=where / "resumed", resume=saved)
        out.append((record_of(full, mesh.group("tp")), record_of(resumed, mesh.group("tp"))))
    return out


@pytest.mark.equivalence
def test_a_resumed_layout_continues_as_the_uninterrupted_run(tmp_path):
    """Same mesh, same data, on the CPU: the resumed steps' losses and norms and the final
    parameters are bitwise those of the run that went on (bf16 included: the checkpoint
    holds the fp32 master weights and the moments)."""
    configs = [layout_config(layout) for layout in RESUMED]
    for cfg in configs:
        cfg.train.checkpoint_every = SAVED_AT
        if cfg.train.dtype == "float16":
            cfg.train.loss_scale = OVERFLOWING_SCALE
    per_rank = run_distributed(resumed_runs, 2, configs, tiny_data(), str(tmp_path))
    fp16 = per_rank[0][RESUMED.index("dp fp16")][0]
    assert not math.isfinite(fp16.grad_norms[SAVED_AT - 1]), fp16.grad_norms  # skipped
    for records in per_rank:
        for layout, (full, resumed) in zip(RESUMED, records, strict=True):
            assert resumed.losses == full.losses[SAVED_AT:], layout
            assert resumed.grad_norms == full.grad_norms[SAVED_AT:], layout
            for name, value in full.state.items():
                assert resumed.state[name].equal(value), (layout, name)
