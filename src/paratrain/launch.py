"""Start N local workers through PyTorch's elastic launcher, the machinery behind torchrun.

Each worker runs `python -m paratrain train --config RUN_DIR/config.toml` with torchrun's
environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...). The rendezvous is c10d on
localhost with port 0, so the store picks a free port itself (torchrun --standalone).
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import uuid
from pathlib import Path
from signal import SIGKILL, SIGTERM
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

WORKER_FLAG = "--launched-worker"  # tells a worker that the launcher prepared the run dir
# How long a signalled launcher waits for its workers to finish their step and save before
# it kills them (torch's default, 30 s, is shorter than a large model's step and save).
SHUTDOWN_TIMEOUT_S = 600


def torchrun_env() -> dict[str, Any] | None:
    """Rank facts when started by torchrun / elastic launch, else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    return {
        "rank": int(os.environ["RANK"]),
        "world_size": int(os.environ["WORLD_SIZE"]),
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
        "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "agent_store": (
            f"{os.environ.get('MASTER_ADDR', 'localhost')}:{os.environ.get('MASTER_PORT', '0')}"
            if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            else ""
        ),
    }


class WorkersFailed(RuntimeError):
    """A worker exited with an error; its own error line (exit status 2: a user error) or
    traceback went to the terminal."""

    def __init__(self, message: str, exitcode: int = 1) -> None:
        super().__init__(message)
        self.exitcode = exitcode


def launch_local(
    nproc: int, config_path: Path, extra_args: list[str] | None = None, max_restarts: int = 0
) -> None:
    """Run N training workers; after a failure restart them all, up to max_restarts times
    (each restarted worker sees TORCHELASTIC_RESTART_COUNT and resumes from the last
    checkpoint)."""
    argv = ["train", "--config", str(config_path), WORKER_FLAG, *(extra_args or [])]
    launch_workers(nproc, argv, max_restarts)


def launch_workers(nproc: int, argv: list[str], max_restarts: int = 0) -> None:
    """Run `python -m paratrain ARGV` in N local workers with torchrun's environment."""
    # torch here, not at the top: a refused command never loads it (cli answers in < 2 s)
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    # The agent's per-rank error files, in a directory removed once the launch is over
    # (and its failure line read): torch's default, a torchelastic_* in /tmp, stays.
    with tempfile.TemporaryDirectory(prefix="paratrain-elastic-") as logs:
        _launch(nproc, argv, max_restarts, DefaultLogsSpecs(log_dir=logs))


def _launch(nproc: int, argv: list[str], max_restarts: int, logs_specs: Any) -> None:
    """launch_workers' launch, its agent's files under `logs_specs`."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from paratrain.comm import compat

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"paratrain-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
        logs_specs=logs_specs,
        **compat.launch_shutdown_timeout(SHUTDOWN_TIMEOUT_S),
    )
    # The agent's own lines ("Sending process ... SIGTERM", "failed (exitcode: 1) ...")
    # repeat what `failure_line` says.
    agent_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    level = agent_log.level
    agent_log.setLevel(logging.CRITICAL)
    # "Received SIGINT death signal, shutting down workers": `paratrain train` says how the
    # run stopped, in one line, once the workers have saved.
    signal_log = logging.getLogger("torch.distributed.elastic.agent.server.api")
    signal_log.addFilter(_not_about_signals)
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", "paratrain", *argv)
    except ChildFailedError as e:
        rank, failure = root_failure(e.failures)
        raise WorkersFailed(failure_line(rank, failure), failure.exitcode) from None
    finally:
        agent_log.setLevel(level)
        signal_log.removeFilter(_not_about_signals)


def _not_about_signals(record: logging.LogRecord) -> bool:
    return "death signal" not in record.getMessage()


def root_failure(failures: dict[int, ProcessFailure]) -> tuple[int, ProcessFailure]:
    """The failure to name: a worker killed from outside (it could say nothing), else the
    one that printed its error (it alone writes an error file, train/failure.py), else
    the first observed."""
    killed = [r for r, f in failures.items() if f.exitcode < 0 and -f.exitcode != SIGTERM]
    spoke = [r for r, f in failures.items() if Path(f.error_file).is_file()]
    observed = sorted(failures, key=lambda r: (failures[r].timestamp, r))
    rank = (killed or spoke or observed)[0]
    return rank, failures[rank]


def failure_line(rank: int, failure: ProcessFailure) -> str:
    """What the launcher says; it never announces output the worker did not print."""
    head = f"worker rank {rank} failed with exit code {failure.exitcode}"
    if failure.exitcode == -SIGKILL:  # what the kernel's out-of-memory killer sends
        return f"{head} (killed by SIGKILL, maybe for lack of memory; it printed nothing)"
    if failure.exitcode < 0:
        return f"{head} (killed by {failure.signal_name()}; it printed nothing)"
    if not Path(failure.error_file).is_file():
        return f"{head} (it reported no error)"
    # Exit status 2 is a user error: the worker printed one line, no traceback.
    printed = "its error is" if failure.exitcode == 2 else "its traceback is"
    return f"{head} ({printed} printed above)"
