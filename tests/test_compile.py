"""--compile (parallel/compile.py): each block compiled, training equal to one process.

One launch of 2 ranks trains eight compiled layouts in turn: data parallel (dp 2),
ZeRO-1 and ZeRO-2 (their gradient hooks fire outside the compiled forward), ZeRO-3 (FSDP
units gathered in each block's pre-hook), tensor parallel with full recomputation (the
seams are graph breaks; the checkpoint wraps the compiled forward), tensor parallel with
sequence parallelism (its gathers and scatters are seams too), a 1F1B pipeline (one
block per stage, each rank compiling its own), and LoRA under data parallelism
(adapters on frozen bases). Each is held against plain single-process
PyTorch without compilation (tests/equivalence.py's reference): per step loss and global
gradient norm, every final parameter under its plain name (so no `_orig_mod.` prefix), and
the whole parameter vector within 1e-5 relative. inductor with `fallback_random` keeps
every op's arithmetic but may fuse and reorder float32 sums: measured, losses within
1.5e-7 relative and the parameter vector within 2.4e-6, the same as the uncompiled layouts
(Adam turns rounding of near-zero gradients, such as attention's key bias, into moves of
up to lr per element, which is why the vector and not each element is held to 1e-5).

Each rank's compile report must show every block of its stage compiled (one graph or
more), no graph break but at tensor parallelism's seams (and some there under tp), no
eager fallback, and compile time reported on the first step only.
"""

from __future__ import annotations

import math
import os

from paratrain.validate import resolve_and_check
from tests.distributed import run_distributed
from tests.equivalence import (
    References,
    RunRecord,
    assert_equivalent,
    record_of,
    tiny_config,
    tiny_data,
)

REL = 1e-5  # issue 18: losses and parameters within 1e-5 relative of one process
LAYOUTS = {  # name -> (parallel fields, train fields)
    "dp": ({"dp": 2}, {}),
    "zero1": ({"dp": 2, "zero": 1}, {}),
    "zero2": ({"dp": 2, "zero": 2}, {}),
    "zero3": ({"dp": 2, "zero": 3}, {}),
    "tp rc-full": ({"tp": 2}, {"recompute": "full"}),
    "tp sp": ({"tp": 2, "sequence_parallel": True}, {}),
    "1f1b": ({"pp": 2, "schedule": "1f1b"}, {}),
    "dp lora": ({"dp": 2}, {"lora_rank": 4}),  # frozen bases, adapters through the blocks
}


def compiled_config(parallel: dict, train: dict):
    cfg = tiny_config(steps=2, val_batches=0, compile=True, **train)
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    cfg.parallel.nproc = 2
    return resolve_and_check(cfg, 2)


def train_compiled(rank, world_size, configs, data, cache):
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # the forkserver predates the fixture
    from paratrain.mesh import Mesh
    from paratrain.train.loop import train

    out = []
    for cfg in configs:
        p = cfg.parallel
        mesh = Mesh.build(dp=p.dp, pp=p.pp, tp=p.tp)
        result = train(cfg, mesh, data)
        compile_s = [m.compile_s for m in result.metrics]
        out.append(
            (record_of(result, mesh.group("tp")), result.engine.compiled.report(), compile_s)
        )
    return out


def assert_within(parallel: RunRecord, reference: RunRecord) -> None:
    for a, b in zip(parallel.losses, reference.losses, strict=True):
        assert math.isclose(a, b, rel_tol=REL), f"loss {a} != reference {b}"
    diff = sum(float(((parallel.state[n] - r) ** 2).sum()) for n, r in reference.state.items())
    norm = sum(float((r**2).sum()) for r in reference.state.values())
    assert math.sqrt(diff / norm) <= REL, f"parameters differ by {math.sqrt(diff / norm):.3g}"


def test_compiled_layouts_match_single_process(inductor_cache):
    configs = [compiled_config(*LAYOUTS[name]) for name in LAYOUTS]
    data = tiny_data()
    per_rank = run_distributed(train_compiled, 2, configs, data, inductor_cache, timeout=900)
    references = References(data)
    for i, (name, cfg) in enumerate(zip(LAYOUTS, configs, strict=True)):
        reference, initial = references(cfg)
        state = {}
        for rank_runs in per_rank:
            state.update(rank_runs[i][0].state)
        first = per_rank[0][i][0]
        record = RunRecord(first.losses, first.grad_norms, state)
        try:
            assert_equivalent(record, reference, initial)
            assert_within(record, reference)
            for rank, rank_runs in enumerate(per_rank):
                report, compile_s = rank_runs[i][1], rank_runs[i][2]
                assert report.graphs and all(n >= 1 for n in report.graphs.values()), (
                    f"rank {rank}: a block was not compiled: {report.graphs}"
                )
                assert not report.other_breaks, f"rank {rank}: {report.other_breaks}"
                assert report.fallbacks == 0
                assert (report.seam_breaks > 0) == (cfg.parallel.tp > 1)
                assert compile_s[0] > 0 and compile_s[1:] == [0.0] * (len(compile_s) - 1)
        except AssertionError as e:
            e.add_note(f"layout {name}")
            raise
    stages = list(LAYOUTS).index("1f1b")
    blocks = [set(rank_runs[stages][1].graphs) for rank_runs in per_rank]
    assert blocks == [{"blocks.0"}, {"blocks.1"}], "each pipeline stage compiles its own block"


def test_compile_without_a_cpp_compiler_is_refused_before_any_worker(monkeypatch, tmp_path, capsys):
    """inductor builds its CPU kernels with a C++ compiler: without one on PATH the run is
    refused in one line, exit status 2, and no worker starts (the launcher is a tripwire)."""
    from paratrain.cli import main
    from paratrain.parallel.compile import cpp_compilers, find_cpp_compiler

    assert find_cpp_compiler(cpp_compilers()) is not None  # this machine has one
    (tmp_path / "text.txt").write_text("some text to train on. " * 400)
    monkeypatch.setenv("PATH", str(tmp_path))  # a folder without compilers
    assert find_cpp_compiler(cpp_compilers()) is None

    def tripwire(*args, **kwargs):
        raise AssertionError("a worker was started")

    monkeypatch.setattr("paratrain.launch.launch_local", tripwire)
    monkeypatch.setattr("paratrain.train.worker.run_worker", tripwire)
    argv = ["train", "--compile", "--nproc", "1", "--device", "cpu", "--steps", "1"]
    assert main([*argv, "--data", str(tmp_path / "text.txt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--compile on the CPU needs a C++ compiler" in err[0], err
