"""`paratrain train` started as a user starts it, in its own process group, and stopped
with everything it started when its test ends: a test that fails or times out mid-run
would otherwise leave its launcher, group agents and workers running (seen: two fault-
tolerance runs still burning CPU 30 minutes after their test failed, slowing what ran
next)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.distributed import under_nccl_order

STARTED: list[subprocess.Popen] = []  # this test process's runs; conftest stops them


def start(*args: str, cwd: Path) -> subprocess.Popen:
    """`paratrain train ARGS` started in cwd; a multi-process run under NCCL's order."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "paratrain", *under_nccl_order(["train", *args], cwd)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        start_new_session=True,  # its own process group: stop_leftovers kills all of it
    )
    STARTED.append(proc)
    return proc


def finish(proc: subprocess.Popen, timeout: float = 600) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def stop_leftovers() -> None:
    """Kill the process group of every run started here (a finished run's group may still
    hold a straggler), then forget them."""
    for proc in STARTED:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # the group is gone
        if proc.poll() is None:
            proc.wait()
    STARTED.clear()
