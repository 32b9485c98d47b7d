"""`paratrain eval --nproc N` on a mesh (issue 16): the same loss as in one process.

A tiny Llama run trained in one process is evaluated through the real launcher on a
pipeline and with ZeRO-3, in float32 (tensor parallelism builds its part of the model as
training does, whose equivalence tests/test_llama.py shows); the windows end with a
partial one, whose padding must stay out of the mean (the pipeline runs equal-weight
micro-batches, so the padded one runs alone).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from paratrain.cli import main

WINDOW = 20
MODEL = ["--model", "llama-tiny", "--n-layer", "2", "--d-model", "32", "--n-head", "4",
         "--n-kv-head", "2", "--ffn-hidden", "64", "--seq-len", "32", "--global-batch", "4",
         "--micro-batch", "2", "--steps", "2", "--nproc", "1", "--val-batches", "0"]  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("eval-mesh")
    data = tmp / "text.txt"
    data.write_text("".join(f"line {i}: the tokens of a small test. " for i in range(60))[:1987])
    assert main(["train", *MODEL, "--data", str(data), "--out", str(tmp / "run")]) == 0
    return tmp / "run", data


@pytest.fixture(scope="module")
def one_process(run) -> dict:
    return _eval(*run)


def _eval(run_dir: Path, data: Path, *layout: str) -> dict:
    argv = ["eval", str(run_dir), "--data", str(data), "--seq-len", str(WINDOW), "--json"]
    proc = subprocess.run(
        [sys.executable, "-m", "paratrain", *argv, *layout],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.e2e
@pytest.mark.parametrize("layout", [["--pp", "2"], ["--zero", "3"]], ids=["pp2", "dp2-zero3"])
def test_eval_on_a_mesh_equals_one_process(run, one_process, layout):
    run_dir, data = run
    one = one_process
    # the last batch of two windows: a full one and a partial one, padded
    assert (1987 - 1) % WINDOW != 0 and (1987 - 1) // WINDOW % 2 == 1
    mesh = _eval(run_dir, data, "--nproc", "2", *layout)
    assert mesh["tokens"] == one["tokens"] == 1986
    assert mesh["loss"] == pytest.approx(one["loss"], rel=1e-6, abs=0)


def test_a_layout_the_model_cannot_take_is_refused_before_launch(run, capsys):
    run_dir, data = run
    code = main(["eval", str(run_dir), "--data", str(data), "--nproc", "2", "--tp", "3"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "tp" in err[0], err


def test_without_data_eval_scores_the_runs_own_held_out_split(run, tmp_path, capsys):
    """No --data: the split the run validated on (its data, val fraction and tokenizer),
    the same loss as that split given as ids; an imported model, which has no split of its
    own, is refused in one line (tests/test_inspect_run.py's fixture)."""
    from paratrain.config.toml_file import from_toml_text
    from paratrain.data.tokens import load_tokens

    run_dir, data = run
    cfg = from_toml_text((run_dir / "config.toml").read_text())
    held = load_tokens(str(data), cfg.data.val_fraction, cfg.data.tokenizer).val[:]
    ids = tmp_path / "held.bin"
    ids.write_bytes(held.to(dtype=torch.int16).numpy().tobytes())
    scores = []
    for extra in ([], ["--data", str(ids)]):
        capsys.readouterr()
        assert main(["eval", str(run_dir), "--seq-len", str(WINDOW), "--json", *extra]) == 0
        scores.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert scores[0] == scores[1] and scores[0]["tokens"] == held.numel() - 1
