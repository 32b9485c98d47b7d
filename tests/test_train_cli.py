"""End to end: `paratrain train` as a user runs it, through the real launcher.

These start real processes (about 5-15 s each), so they use a small model and few steps.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from paratrain.cli import main
from tests.distributed import under_nccl_order

SMALL = [
    "--n-layer",
    "2",
    "--d-model",
    "64",
    "--seq-len",
    "64",
    "--global-batch",
    "8",
    "--micro-batch",
    "4",
    "--warmup-steps",
    "2",
    "--val-batches",
    "2",
]


def paratrain(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """`paratrain ARGS` in cwd, which must succeed; a multi-process run under NCCL's order."""
    proc = subprocess.run(
        [sys.executable, "-m", "paratrain", *under_nccl_order(args, cwd)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def last_json(proc: subprocess.CompletedProcess) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


def losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


@pytest.mark.e2e
def test_train_two_workers_writes_a_complete_run_directory(tmp_path):
    out = tmp_path / "run"
    proc = paratrain(
        "train", *SMALL, "--steps", "12", "--lr", "0.01", "--json", "--out", str(out), cwd=tmp_path
    )
    summary = last_json(proc)
    for key in (
        "initial_loss",
        "final_loss",
        "val_loss",
        "steps",
        "world_size",
        "tokens_per_s",
        "run_dir",
    ):
        assert key in summary
    assert summary["world_size"] == 2 and summary["steps"] == 12
    assert summary["final_loss"] < summary["initial_loss"] - 1.0
    assert summary["val_loss"] < summary["initial_loss"]
    assert Path(summary["run_dir"]) == out
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(1, 13))
    for key in ("loss", "lr", "tokens_per_s", "grad_norm", "compute_s", "comm_s", "data_s"):
        assert all(key in s for s in steps)
    assert all(s["comm_s"] > 0 for s in steps)  # two replicas: gradients were all-reduced
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"
    config = (out / "config.toml").read_text()
    assert "[parallel]" in config and "dp = 2" in config and "microbatches = 1" in config
    provenance = json.loads((out / "provenance.json").read_text())
    assert len(provenance["data_fingerprint_sha256"]) == 64
    (start,) = provenance["starts"]
    for key in ("python", "torch", "paratrain", "git_commit", "started", "ended"):
        assert start[key]
    assert (
        start["command"][:2] == ["paratrain", "train"]
        and "--launched-worker" not in start["command"]
    )
    assert start["steps"] == [1, 12] and start["layout"]["dp"] == 2


@pytest.mark.e2e
def test_same_seed_gives_bitwise_the_same_losses_and_another_seed_others(tmp_path):
    """Two workers (one process runs the same loop in-process, as the equivalence tests
    do); the losses compared bitwise, as floats parsed from the same JSON text."""
    text = tmp_path / "data.txt"
    text.write_bytes(Path(json.__file__).read_bytes() * 4)

    def run(name: str, *seed: str) -> list[float]:
        out = tmp_path / name
        argv = [*SMALL, "--nproc", "2", "--steps", "6", "--data", str(text), *seed]
        paratrain("train", *argv, "--out", str(out), cwd=tmp_path)
        return losses(out)

    first = run("run0")
    assert run("run1") == first
    assert run("other-seed", "--seed", "7") != first


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.e2e
def test_two_torchrun_agents_as_two_nodes(tmp_path):
    """Two torchrun agents on this machine, each a 'node' with one worker, c10d rendezvous."""
    port = free_port()
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agents = []
    for node in range(2):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--node-rank",
            str(node),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            "paratrain-e2e",
            "--rdzv-conf",
            f"is_host={1 if node == 0 else 0}",
            "-m",
            "paratrain",
            "train",
            *SMALL,
            "--steps",
            "4",
            "--json",
            "--out",
            str(out),
        ]
        agents.append(
            subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=tmp_path,
                env=env,
            )
        )
    outputs = [a.communicate(timeout=600) for a in agents]
    for agent, (stdout, stderr) in zip(agents, outputs, strict=False):
        assert agent.returncode == 0, f"{stdout}\n{stderr}"
    summary = json.loads(outputs[0][0].strip().splitlines()[-1])
    assert summary["world_size"] == 2 and summary["dp"] == 2
    assert summary["final_loss"] < summary["initial_loss"]
    assert len(losses(out)) == 4


@pytest.mark.e2e
def test_trace_writes_the_last_steps_timeline_of_every_stage(tmp_path):
    out = tmp_path / "run"
    flags = ["--nproc", "2", "--pp", "2", "--trace", "--steps", "2", "--json"]
    proc = paratrain("train", *SMALL, *flags, "--out", str(out), cwd=tmp_path)
    trace = json.loads((out / "trace.json").read_text())
    compute = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] == 0]
    k = 2  # G / b = 8 / 4 micro-batches, 1F1B
    for stage in (0, 1):
        names = sorted(e["name"] for e in compute if e["pid"] == stage)
        assert names == sorted([f"F{i}" for i in range(k)] + [f"B{i}" for i in range(k)])
    assert (out / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    facts = last_json(proc)["trace"]
    assert facts["peak_in_flight"] == [2, 1]  # 1F1B: S - stage
    first, last = facts["peak_in_flight_bytes"]
    assert first > 0 and last > 0


@pytest.mark.e2e
@pytest.mark.parametrize("layout", [("--tp", "2"), ("--pp", "2")])
def test_the_llama_preset_trains_from_the_cli(tmp_path, layout):
    text = tmp_path / "data.txt"
    text.write_bytes(Path(json.__file__).read_bytes() * 4)
    out = tmp_path / "run"
    flags = ["--model", "llama-tiny", "--nproc", "2", *layout, "--steps", "8", "--lr", "0.01"]
    small = ["--seq-len", "64", "--global-batch", "8", "--micro-batch", "4", "--warmup-steps", "2"]
    proc = paratrain(
        "train", *flags, *small, "--data", str(text), "--json", "--out", str(out), cwd=tmp_path
    )
    summary = last_json(proc)
    assert summary["final_loss"] < summary["initial_loss"] - 0.5
    assert summary["params"] == 803_968  # the preset's shape: GQA, SwiGLU, untied
    # the planner's prediction for the Llama layout is the runtime's own count
    predicted = [r["total"] for r in summary["predicted"]["model_state_bytes"]]
    assert predicted == summary["model_state_bytes_per_rank"]
    config = (out / "config.toml").read_text()
    assert 'name = "llama-tiny"' in config and 'arch = "llama"' in config


@pytest.mark.e2e
def test_tensorboard_event_files_hold_every_steps_metrics(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    flags = ["--nproc", "2", "--steps", "5", "--tensorboard", "--json", "--out", str(out)]
    summary = last_json(paratrain("train", *SMALL, *flags, cwd=tmp_path))
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for name in ("loss", "lr", "grad_norm", "tokens_per_s", "comm_s", "compute_s"):
        logged = events.Scalars(f"train/{name}")
        assert [e.step for e in logged] == [r["step"] for r in rows]
        for event, row in zip(logged, rows, strict=True):
            assert abs(event.value - row[name]) <= 1e-6 * max(1.0, abs(row[name]))  # float32
    (val,) = events.Scalars("val/loss")
    assert val.step == 5 and abs(val.value - summary["val_loss"]) < 1e-5


@pytest.mark.e2e
def test_tokenizer_prepare_train_sample_eval_from_the_cli(tmp_path):
    corpus = Path(json.__file__).parent
    tok, data, out = tmp_path / "tok.json", tmp_path / "data", tmp_path / "run"
    paratrain(
        "tokenizer",
        "train",
        "--data",
        str(corpus),
        "--vocab-size",
        "300",
        "--out",
        str(tok),
        cwd=tmp_path,
    )
    paratrain(
        "prepare", "--data", str(corpus), "--tokenizer", str(tok), "--out", str(data), cwd=tmp_path
    )
    flags = ["--data", str(data), "--nproc", "2", "--tp", "2", "--steps", "6", "--json"]
    small = ["--seq-len", "64", "--global-batch", "8", "--micro-batch", "4", "--n-layer", "2"]
    summary = last_json(paratrain("train", *flags, *small, "--out", str(out), cwd=tmp_path))
    assert summary["final_loss"] < summary["initial_loss"]
    assert "vocab_size = 384" in (out / "config.toml").read_text()  # 300 padded for tp
    text = paratrain(
        "sample", str(out), "--prompt", "import ", "--max-new-tokens", "20", cwd=tmp_path
    )
    assert text.stdout.startswith("import ")
    result = last_json(paratrain("eval", str(out), "--data", str(data), "--json", cwd=tmp_path))
    assert result["tokens"] > 0 and abs(result["perplexity"] - math.exp(result["loss"])) < 1e-6


@pytest.mark.e2e
def test_a_start_that_fails_in_the_workers_exits_2_and_leaves_no_run_directory(tmp_path):
    from tests.test_hf import _llama

    source = tmp_path / "imported"  # in this process: an interpreter less to start
    assert main(["import-hf", str(_llama(tmp_path, False, 256)), "--out", str(source)]) == 0
    # Claim a third block that the weights do not have: only loading them can tell.
    for path in (source / "config.toml", *source.glob("checkpoints/*/paratrain.json")):
        text = path.read_text()
        path.write_text(
            text.replace("n_layer = 2", "n_layer = 3").replace('"n_layer": 2', '"n_layer": 3')
        )
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "paratrain", "train", "--init-from", str(source), "--nproc", "2"]
        + ["--steps", "1", "--seq-len", "32", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr
    assert "no weights for blocks.2" in proc.stderr
    assert "its error is printed above" in proc.stderr and "Traceback" not in proc.stderr
    assert "the new run directory" in proc.stderr and not out.exists()
