"""Reporting after a resume on another layout (issue 30): the summary's tokens/s and times
are this start's, the bytes line names the global step, and provenance.json keeps every
start with its times, the command the user typed and its layout."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed import under_nccl_order

TINY = [
    "--n-layer", "1", "--d-model", "32", "--n-head", "2", "--seq-len", "32",
    "--global-batch", "4", "--micro-batch", "2", "--val-batches", "1", "--checkpoint-every", "2",
]  # fmt: skip


def paratrain(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "paratrain", *under_nccl_order(argv, cwd)],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    return proc


@pytest.mark.e2e
def test_a_resume_on_another_layout_reports_its_own_start(tmp_path):
    out = tmp_path / "run"
    first = ["train", *TINY, "--nproc", "1", "--steps", "4", "--out", str(out)]
    paratrain(first, tmp_path)
    second = ["train", "--resume", str(out), "--nproc", "2", "--steps", "7", "--json"]
    proc = paratrain(second, tmp_path)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 8)) and summary["steps"] == 7
    this_start = [r for r in rows if r["step"] >= 5]  # the first of them pays for warm-up
    assert summary["tokens_per_s"] == statistics.median(r["tokens_per_s"] for r in this_start[1:])
    assert summary["train_s"] == pytest.approx(sum(r["step_s"] for r in this_start))
    assert "bytes sent in step 7: dp " in proc.stderr, proc.stderr
    starts = json.loads((out / "provenance.json").read_text())["starts"]
    assert [s["command"] for s in starts] == [
        ["paratrain", *under_nccl_order(first, tmp_path)],
        ["paratrain", *under_nccl_order(second, tmp_path)],
    ]
    assert [s["steps"] for s in starts] == [[1, 4], [5, 7]]
    assert [s["layout"]["world_size"] for s in starts] == [1, 2]
    assert starts[0]["started"] <= starts[0]["ended"] <= starts[1]["started"] <= starts[1]["ended"]
