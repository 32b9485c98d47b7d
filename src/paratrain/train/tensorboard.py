"""`--tensorboard`: the run's per-step metrics as TensorBoard event files, beside
metrics.jsonl (which stays the record), in RUN_DIR/tensorboard/.

    tensorboard --logdir runs/   # every run's curves side by side

Scalars under `train/`: loss, lr, grad_norm, tokens_per_s, step_s and its parts compute_s,
comm_s (blocked in collectives) and data_s; under `val/`: the final validation loss.
Under fault tolerance each replica group writes its own run, RUN_DIR/tensorboard/group-G/:
the steps it committed (the loss is the same in every group: the participants' mean;
the times are the group's own).
"""

from __future__ import annotations

import math
from pathlib import Path

from paratrain.train.metrics import StepMetrics

LOG_DIR = "tensorboard"
SCALARS = ("loss", "lr", "grad_norm", "tokens_per_s", "step_s", "compute_s", "comm_s", "data_s")


class TensorBoardWriter:
    def __init__(self, run_dir: Path, run: str = "") -> None:
        """run: a subdirectory, which TensorBoard shows as a run of its own (fault
        tolerance's replica groups: each writes the steps it committed)."""
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self._writer = SummaryWriter(log_dir=str(run_dir / LOG_DIR / run))
        self._last_step = 0

    def write(self, m: StepMetrics) -> None:
        for name in SCALARS:
            self._writer.add_scalar(f"train/{name}", getattr(m, name), m.step)
        self._last_step = m.step

    def validation(self, loss: float) -> None:
        if math.isfinite(loss):
            self._writer.add_scalar("val/loss", loss, self._last_step)

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()
