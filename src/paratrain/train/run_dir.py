"""The run directory: resolved config, per-step metrics, loss plot, summary (provenance:
train/provenance.py)."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from paratrain.config import RunConfig
from paratrain.config.toml_file import to_toml
from paratrain.train.metrics import StepMetrics

log = logging.getLogger(__name__)

CONFIG_FILE = "config.toml"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
PLOT_FILE = "loss.png"


def prepare_run_dir(out: str) -> Path:
    """Create a fresh run directory; never write into one that already holds files."""
    if out:
        path = Path(out)
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise ValueError(
                f"--out {out!r} already exists and is not empty; give a new directory so that "
                "no earlier run is overwritten"
            )
    else:
        base = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
        path, n = base, 1
        while path.exists():
            n += 1
            path = base.with_name(f"{base.name}-{n}")
    flag = "--out" if out else "the default run directory"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{flag} {str(path)!r} cannot be created: {_cause(e)}") from None
    return check_writable(path, flag)


def check_writable(path: Path, flag: str) -> Path:
    """`path`, after writing and removing a file in it (a read-only filesystem, or a
    directory this user may not write, fails here rather than in a worker)."""
    probe = path / ".paratrain-write-check"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"{flag} {str(path)!r} cannot be written: {_cause(e)}") from None
    return path


def _cause(e: OSError) -> str:
    where = f" ({e.filename})" if e.filename else ""
    return f"{e.strerror or e}{where}; give a directory that can be created and written"


def worker_run_dir(out: str, resume: str) -> Path:
    """Where rank 0 of a user's torchrun writes: a new --out, or --resume's run directory
    (writable, its config kept as config.<n>.toml before this start rewrites it)."""
    if not resume:
        return prepare_run_dir(out)
    path = check_writable(Path(resume), "--resume")
    keep_previous_config(path)
    return path


def keep_previous_config(run_dir: Path) -> None:
    """Before a resumed run rewrites config.toml: keep the old one as config.<n>.toml."""
    path = run_dir / CONFIG_FILE
    if path.exists():
        n = 1
        while (run_dir / f"config.{n}.toml").exists():
            n += 1
        path.rename(run_dir / f"config.{n}.toml")


def write_config(run_dir: Path, cfg: RunConfig) -> Path:
    path = run_dir / CONFIG_FILE
    path.write_text(to_toml(cfg))
    return path


class MetricsWriter:
    """Appends one JSON object per step, flushed at once so a crashed run keeps its steps."""

    def __init__(self, run_dir: Path) -> None:
        self._file = (run_dir / METRICS_FILE).open("a")

    def write(self, m: StepMetrics) -> None:
        self._file.write(json.dumps(m.as_dict()) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_metrics(run_dir: Path) -> list[dict[str, float]]:
    lines = (run_dir / METRICS_FILE).read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def read_step_metrics(run_dir: Path) -> list[StepMetrics]:
    return [StepMetrics.from_dict(row) for row in read_metrics(run_dir)]


def truncate_metrics(run_dir: Path, last_step: int) -> None:
    """Drop the rows after `last_step` (steps a crashed run did past its last checkpoint),
    so that a resumed run logs every step exactly once. The file is replaced atomically."""
    path = run_dir / METRICS_FILE
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= last_step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):  # a line torn by the crash
            continue
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    tmp.replace(path)


def write_loss_plot(run_dir: Path, metrics: list[StepMetrics], val_loss: float) -> Path | None:
    """loss.png; None, said in the log, where matplotlib is not installed (a GPU machine's
    own Python may lack it: the run's other files do not need it)."""
    try:
        import matplotlib
    except ImportError:
        log.warning("%s not written: matplotlib is not installed", PLOT_FILE)
        return None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([m.step for m in metrics], [m.loss for m in metrics], label="train loss")
    if metrics and val_loss == val_loss:  # not NaN
        ax.scatter([metrics[-1].step], [val_loss], color="C1", zorder=3, label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(f"paratrain: {run_dir.name}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = run_dir / PLOT_FILE
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    (run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")


def read_summary(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / SUMMARY_FILE).read_text())
