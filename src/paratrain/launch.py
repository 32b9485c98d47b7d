"""Start N local workers through PyTorch's elastic launcher, the machinery behind torchrun.

Each worker runs `python -m paratrain train --config RUN_DIR/config.toml` with torchrun's
environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...). The rendezvous is c10d on
localhost with port 0, so the store picks a free port itself (torchrun --standalone).
"""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

WORKER_FLAG = "--launched-worker"  # tells a worker that the launcher prepared the run dir


class WorkersFailed(RuntimeError):
    """A worker exited with an error; its own error line (exit status 2: a user error) or
    traceback went to the terminal."""

    def __init__(self, message: str, exitcode: int = 1) -> None:
        super().__init__(message)
        self.exitcode = exitcode


def launch_local(
    nproc: int, config_path: Path, extra_args: list[str] | None = None, max_restarts: int = 0
) -> None:
    """Run N workers; after a failure restart them all, up to max_restarts times (each
    restarted worker sees TORCHELASTIC_RESTART_COUNT and resumes from the last checkpoint)."""
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
    )
    args = ["-m", "paratrain", "train", "--config", str(config_path), WORKER_FLAG]
    try:
        elastic_launch(config, entrypoint=sys.executable)(*args, *(extra_args or []))
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        # Exit status 2 is a user error: the worker printed one line, no traceback.
        printed = "its error is" if failure.exitcode == 2 else "its traceback is"
        raise WorkersFailed(
            f"worker rank {rank} failed with exit code {failure.exitcode} "
            f"({printed} printed above)",
            failure.exitcode,
        ) from None
