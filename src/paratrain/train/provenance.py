"""provenance.json: where a run's numbers came from, every start of it kept.

    {"data_fingerprint_sha256": ..., "data": ...,           # the same for every start
     "starts": [{"command": ["paratrain", "train", ...],     # what the user typed
                 "started": ..., "ended": ...,              # ended: absent if it failed
                 "steps": [first, last],                    # global steps this start ran
                 "layout": {"world_size", "dp", "pp", "tp", "zero", "device", ...},
                 "python", "torch", "paratrain", "git_commit", "host", "platform"}, ...]}

The launcher records a start before any worker runs, with its own command line (a worker's
is the launcher's internal one); rank 0 completes it. Under torchrun, where no launcher of
ours runs, rank 0 records the start itself, with the command it was given.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

import paratrain
from paratrain.data.tokens import TokenData

PROVENANCE_FILE = "provenance.json"
# What a provenance.json written before starts were kept held at its top level.
ONE_START_KEYS: tuple[str, ...] = ("python", "torch", "paratrain", "git_commit", "world_size")
ONE_START_KEYS += ("host", "platform", "command", "started")


def user_command() -> list[str]:
    """This process's command line as the user would type it."""
    return ["paratrain", *sys.argv[1:]]


def record_start(run_dir: Path, command: list[str]) -> None:
    """A start begins: appended before any worker runs."""
    record = read_provenance(run_dir)
    record["starts"].append({"command": command, "started": _now()})
    _write(run_dir, record)


def write_provenance(
    run_dir: Path, data: TokenData, layout: dict[str, Any], recorded: bool
) -> None:
    """Rank 0: the data and this start's environment and layout. recorded: the launcher
    has appended this start (else it is appended here, with this process's command)."""
    record = read_provenance(run_dir)
    record["data_fingerprint_sha256"] = data.fingerprint
    record["data"] = data.description
    if not recorded or not record["starts"]:
        record["starts"].append({"command": user_command(), "started": _now()})
    record["starts"][-1].update(layout=layout, **_environment())
    _write(run_dir, record)


def end_start(run_dir: Path, first_step: int, last_step: int) -> None:
    """Rank 0, after the start's last step (finished, or stopped by a signal)."""
    record = read_provenance(run_dir)
    record["starts"][-1].update(ended=_now(), steps=[first_step, last_step])
    _write(run_dir, record)


def read_provenance(run_dir: Path) -> dict[str, Any]:
    path = run_dir / PROVENANCE_FILE
    record: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    if record and "starts" not in record:  # written before every start was kept
        old = {k: record.pop(k) for k in ONE_START_KEYS if k in record}
        record["starts"] = [old]
    record.setdefault("starts", [])
    return record


def _write(run_dir: Path, record: dict[str, Any]) -> None:
    (run_dir / PROVENANCE_FILE).write_text(json.dumps(record, indent=2) + "\n")


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def _environment() -> dict[str, str]:
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "paratrain": paratrain.__version__,
        "git_commit": git_commit(),
        "host": platform.node(),
        "platform": platform.platform(),
    }


def git_commit() -> str:
    """The commit of the source tree paratrain was imported from, '+dirty' if modified."""
    src = Path(paratrain.__file__).resolve().parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=src, capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0:
            return "unknown (not a git checkout)"
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=src,
            capture_output=True,
            text=True,
            timeout=10,
        )
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.TimeoutExpired):
        return "unknown (git not available)"
