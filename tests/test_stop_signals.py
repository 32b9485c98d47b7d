"""Stopping a run (issue 30), end to end through the real launcher in a pseudo-terminal:
Ctrl-C (SIGINT to the terminal's foreground process group, typed into the terminal)
finishes the step on every rank, saves a checkpoint and says so in one line, exit 130; a
second Ctrl-C stops at once; a stop message suggests `--resume` only when it will work.

Rank 1 sleeps in each step (`--straggler`; the numbers do not change) so that there is
time to type into the terminal mid-step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from paratrain import checkpoint as ck
from tests.distributed import under_nccl_order
from tests.terminal import Terminal, screen_lines

TINY = [
    "--n-layer", "1", "--d-model", "32", "--n-head", "2", "--seq-len", "32",
    "--global-batch", "4", "--micro-batch", "2", "--val-batches", "1", "--nproc", "2",
    "--steps", "6", "--checkpoint-every", "0",
]  # fmt: skip


def in_terminal(argv: list[str], cwd: Path) -> Terminal:
    return Terminal([sys.executable, "-m", "paratrain", *under_nccl_order(argv, cwd)], cwd, 24, 100)


def steps_logged(run_dir: Path) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines]


def the_stop_line(output: str) -> str:
    """The one line that says how the run stopped; nothing else about it."""
    stops = [line for line in screen_lines(output) if "stopped" in line]
    assert len(stops) == 1, output
    # the stop's checkpoint is named by that line alone, not announced before it
    for noise in ("Traceback", "interrupted", "[rank", "death signal", "error", "stop requested"):
        assert noise not in output, output
    return stops[0]


@pytest.mark.e2e
def test_ctrl_c_finishes_the_step_saves_and_the_resume_it_suggests_works(tmp_path):
    out = tmp_path / "run"
    term = in_terminal(["train", *TINY, "--straggler", "1:40", "--out", str(out)], tmp_path)
    term.wait_for("step 2/6 |")  # four steps of 40 times their work left (seconds)
    term.type_ctrl_c()
    code, output = term.finish()
    assert code == 130, output
    saved = ck.latest_checkpoint(out)
    assert saved is not None and 2 <= saved.step < 6, output
    assert the_stop_line(output) == (
        f"paratrain train: stopped by Ctrl-C (SIGINT); checkpoint of step {saved.step} in "
        f"{saved.path}; continue with `paratrain train --resume {out}`"
    )
    assert f"checkpoint step {saved.step}" not in output, output
    assert steps_logged(out) == list(range(1, saved.step + 1))
    resumed = subprocess.run(
        [sys.executable, "-m", "paratrain", "train", "--resume", str(out), "--straggler", "1:1"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert steps_logged(out) == list(range(1, 7))


@pytest.mark.e2e
def test_a_second_ctrl_c_stops_at_once_and_keeps_the_steps_metrics(tmp_path):
    """More Ctrl-Cs after the second (an impatient user) land in the launcher's shutdown
    and its exit: they change nothing, print nothing."""
    out = tmp_path / "run"
    term = in_terminal(["train", *TINY, "--straggler", "1:2000", "--out", str(out)], tmp_path)
    term.wait_for("step 1/6 |")  # rank 1 now sleeps 2000 times its step's work (10 s or more)
    term.type_ctrl_c()
    time.sleep(2)  # the first has reached the workers
    while term.proc.poll() is None:  # the second, and more, whatever the launcher is doing
        try:
            term.type_ctrl_c()
        except OSError:  # it ended since the poll, and nothing holds the terminal now
            break
        time.sleep(0.1)
    code, output = term.finish()
    assert code == 130, output
    assert ck.latest_checkpoint(out) is None  # step 2 was not finished to save it
    assert the_stop_line(output) == (
        "paratrain train: stopped by Ctrl-C (SIGINT); no checkpoint was saved; "
        f"run directory {out} keeps the steps' metrics"
    )
    assert steps_logged(out) == list(range(1, len(steps_logged(out)) + 1))
    # a range, not a number: step 1 is logged before the first Ctrl-C, and the straggler
    # (rank 1 at 2000 times its work) keeps the run from finishing all 6 before the stop
    assert 1 <= len(steps_logged(out)) < 6


@pytest.mark.e2e
def test_sigterm_before_a_checkpoint_suggests_no_resume_that_would_be_refused(tmp_path):
    out = tmp_path / "run"
    argv = ["train", *TINY, "--straggler", "1:400", "--out", str(out)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "paratrain", *under_nccl_order(argv, tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    deadline = time.monotonic() + 120
    while not (out / "config.toml").exists():  # written just before the workers start
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 143, err
    line = the_stop_line(err)
    assert line.startswith("paratrain train: stopped by SIGTERM; ")
    if ck.latest_checkpoint(out) is None:  # the usual case: no worker had begun a step
        assert "--resume" not in line and "nothing was saved" in line, line
    else:  # a worker got as far as the stop's checkpoint: the resume works
        dry = [sys.executable, "-m", "paratrain", "train", "--resume", str(out), "--dry-run"]
        assert subprocess.run(dry, capture_output=True, cwd=tmp_path).returncode == 0
