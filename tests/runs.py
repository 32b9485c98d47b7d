"""`paratrain train` started as a user starts it, in its own process group, and stopped
with everything it started when its test ends: a test that fails or times out mid-run
would otherwise leave its launcher, group agents and workers running (seen: two fault-
tolerance runs still burning CPU 30 minutes after their test failed, slowing what ran
next)."""

from __future__ import annotations

import contextlib
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
    """Kill the process group of every run started here that is still running, then
    forget them. (Not a finished run's: its pid, the group's id, may be reused by then.)"""
    for proc in STARTED:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it ended since
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    STARTED.clear()
