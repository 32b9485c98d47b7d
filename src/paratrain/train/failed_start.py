"""What a failed start leaves behind: nothing new, and no earlier file changed.

A fresh run that saved no checkpoint and logged no step loses its directory (it held only
what this start wrote), so that `--resume`, `eval`, `sample` and `export` never mistake it
for a run. A resumed run that saved no new checkpoint gets its own files back as they were (a resume
rewrites config.toml, provenance.json and cuts metrics.jsonl before training). A run that
saved a checkpoint before failing stays as it is, to be resumed; one that logged a step
keeps its metrics.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from paratrain.checkpoint import CHECKPOINTS, latest_checkpoint
from paratrain.train.run_dir import METRICS_FILE


@dataclass(frozen=True)
class BeforeStart:
    run_dir: Path
    fresh: bool
    files: dict[Path, bytes]  # everything outside checkpoints/, as it was (small files)
    checkpoint_step: int | None


def before_start(run_dir: Path, fresh: bool) -> BeforeStart:
    """Note what is there, before this start writes anything."""
    files = {} if fresh else {p: p.read_bytes() for p in _own_files(run_dir)}
    ckpt = None if fresh else latest_checkpoint(run_dir)
    return BeforeStart(run_dir, fresh, files, ckpt.step if ckpt else None)


def undo_failed_start(before: BeforeStart) -> str:
    """Put the run directory back as it was unless the start saved a checkpoint; returns
    what became of it, for the error line."""
    run_dir = before.run_dir
    ckpt = latest_checkpoint(run_dir)
    if ckpt is not None and ckpt.step != before.checkpoint_step:
        return f"run directory {run_dir} (resume it from step {ckpt.step})"
    if before.fresh and _steps_logged(run_dir):  # never lose a step's record
        return f"no checkpoint was saved; run directory {run_dir} keeps the steps' metrics"
    if before.fresh:
        shutil.rmtree(run_dir, ignore_errors=True)
        return f"nothing was saved: the new run directory {run_dir} was removed"
    for path in _own_files(run_dir):
        if path not in before.files:
            path.unlink()
    for path, data in before.files.items():
        if not path.is_file() or path.read_bytes() != data:
            path.write_bytes(data)
    return f"nothing was saved: run directory {run_dir} is as it was"


def _steps_logged(run_dir: Path) -> bool:
    metrics = run_dir / METRICS_FILE
    return metrics.is_file() and metrics.stat().st_size > 0


def _own_files(run_dir: Path) -> list[Path]:
    """The run's files outside checkpoints/ (config, metrics, provenance, plots, events)."""
    skip = run_dir / CHECKPOINTS
    return [p for p in run_dir.rglob("*") if p.is_file() and skip not in p.parents]
