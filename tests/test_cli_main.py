"""What a user meets first at the command line (issue 30): --version, help, "did you mean",
no prefix matching, refusals before torch loads, a quiet closed pipe, plurals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from paratrain import __version__
from paratrain.cli import main

ROOT = Path(__file__).resolve().parents[1]


def refused(capsys, *argv: str) -> str:
    """The one line of a refusal (exit 2, argparse's or the command's)."""
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_version_and_help_for_users(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"paratrain {__version__}"
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "usage: paratrain COMMAND" in out and "examples:" in out
    assert ".py" not in out and "tests/" not in out  # no developer notes


@pytest.mark.parametrize(
    ("argv", "suggestion"),
    [
        (["trian"], "did you mean 'train'?"),
        (["train", "--step", "7", "--dry-run"], "did you mean --steps?"),
        (["train", "--tie"], "did you mean --tie-embeddings?"),
        (["train", "--model", "gpt-tinyy"], "did you mean 'gpt-tiny'?"),
        (["train", "--schedule", "1f1c"], "did you mean '1f1b'?"),
        (["plan", "--preset", "llama3-8"], "did you mean 'llama3-8b'?"),
        (["plan", "--sort", "mem"], "did you mean 'memory'?"),
        (["bench", "dp", "--pair", "3"], "did you mean --pairs?"),
    ],
)
def test_misspellings_are_refused_with_the_nearest_valid_one(capsys, argv, suggestion):
    # --step and --tie were silently taken as --steps and --tie-embeddings (allow_abbrev)
    assert suggestion in refused(capsys, *argv)


REFUSALS = [
    ["train", "--nproc", "3", "--dp", "2"],
    ["train", "--nproc", "4", "--pp", "2", "--schedule", "interleaved", "--chunks", "2"],
    ["schedule", "--stages", "0"],
    ["train", "--model", "gpt-tinyy"],
    ["train", "--bogus"],
    ["train", "--data", "/bin/ls", "--dry-run"],
    ["plan", "--preset", "8b"],
    ["bench", "nothing"],
    ["eval", "/nonexistent", "--data", "x.txt"],
    ["export", "/nonexistent"],
    ["sample", "/nonexistent", "--prompt", "x"],
    ["import-hf", "/nonexistent", "--out", "y"],
    ["tokenizer", "train", "--data", "/nonexistent", "--vocab-size", "300", "--out", "t.json"],
    ["prepare", "--data", "/nonexistent", "--tokenizer", "t.json", "--out", "o"],
]


@pytest.mark.parametrize("driver", ["as here", "faked present"])
def test_refusals_answer_before_torch_loads(driver):
    """A refusal needing no torch must not wait for it (seconds): asserted on what was
    imported, not on time, so that a loaded machine cannot fail it. With a GPU driver
    present (faked here, on a CPU machine), `--device auto` could mean either device and
    only torch can say which: a refusal that holds on both is given without it."""
    fake = "import paratrain.machine as m; m.cuda_driver_present = lambda: True\n"
    code = (
        "import json, sys\n"
        + (fake if driver == "faked present" else "")
        + "from paratrain.cli import main\n"
        "seen = []\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    try:\n"
        "        rc = main(argv)\n"
        "    except SystemExit as e:\n"
        "        rc = e.code\n"
        "    seen.append([rc, 'torch' in sys.modules])\n"
        "print(json.dumps(seen))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(REFUSALS)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == [[2, False]] * len(REFUSALS), list(zip(REFUSALS, seen, strict=True))


@pytest.mark.parametrize(
    ("backend", "world", "torch_asked", "said"),
    [
        ("auto", 3, False, "the world size is 3"),  # dp 2 on 3 ranks: on either device
        ("nccl", 2, True, "--backend nccl with --device cpu"),  # only the CPU refuses
        ("gloo", 2, True, None),  # only cuda refuses: torch says this machine has none
    ],
)
def test_auto_device_refusals_torch_need_not_decide_come_without_it(
    monkeypatch, backend, world, torch_asked, said
):
    """A GPU driver is here (faked) and torch not loaded: `--device auto` is checked as
    cpu and as cuda first; torch is asked only when the two answers differ or both pass."""
    import importlib

    from paratrain.config import RunConfig

    check_module = importlib.import_module("paratrain.validate.check")  # not the function
    asked = []
    monkeypatch.setattr(check_module, "cuda_known", lambda: None)
    monkeypatch.setattr(check_module, "cuda_available", lambda: asked.append(1) or False)
    cfg = RunConfig()
    cfg.parallel.nproc, cfg.parallel.dp, cfg.parallel.backend = world, 2, backend
    if said is None:
        assert check_module.resolve_and_check(cfg, world).parallel.device == "cpu"
    else:
        with pytest.raises(ValueError, match=said):
            check_module.resolve_and_check(cfg, world)
    assert bool(asked) == torch_asked


def test_a_closed_pipe_ends_quietly():
    """`paratrain plan --all | head -1`: more output than a pipe holds, reader gone."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "paratrain", "plan", "--preset", "llama3-8b", "--gpus", "64"]
        + ["--all"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )
    assert proc.stdout.readline().startswith(b"recommended: ")
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=600) == 141 and "Traceback" not in err and err == ""


def test_bench_comm_flag_defaults_are_the_sweeps():
    from paratrain.bench.comm import sweep
    from paratrain.commands.bench_flags import COMM_OPS_FLAG, COMM_SIZES_FLAG

    assert (COMM_OPS_FLAG, COMM_SIZES_FLAG) == (",".join(sweep.OPS), sweep.DEFAULT_SIZES_FLAG)


def test_the_summary_counts_in_the_right_plural(capsys):
    from paratrain.commands.train_launch import print_summary

    summary = dict(steps=1, world_size=1, initial_loss=1.0, final_loss=1.0, val_loss=1.0)
    print_summary({**summary, "tokens_per_s": 1.0, "run_dir": "runs/x"}, as_json=False)
    assert "trained 1 step on 1 process:" in capsys.readouterr().out
