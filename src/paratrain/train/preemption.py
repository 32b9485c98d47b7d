"""Preemption: on SIGTERM every rank finishes its step, a checkpoint is saved, and the run
stops cleanly.

The signal reaches the ranks at different moments (or only some of them), so the decision
to stop is agreed once per step: a one-integer all-reduce (max) over the control group
(every rank, host-side gloo), after the step's own communication. Every rank then stops
after the same step. Asynchronous runs have no common step: they ask `signalled` (this
rank's flag, no communication) and let the parameter server decide (train/async_loop.py).
"""

from __future__ import annotations

import signal
from typing import Any

import torch

from paratrain import comm


class Preemption:
    """Callable once per step, collectively: True when any rank has received SIGTERM."""

    def __init__(self, control: comm.CommGroup) -> None:
        self.control = control
        self.requested = False
        self._previous: Any = signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.requested = True

    def signalled(self) -> bool:
        """Whether this rank has received SIGTERM; local, not collective."""
        return self.requested

    def __call__(self) -> bool:
        flag = torch.tensor([int(self.requested)], dtype=torch.int64, device="cpu")  # host-side
        comm.all_reduce(flag, self.control, op="max")
        return bool(flag.item())

    def close(self) -> None:
        signal.signal(signal.SIGTERM, self._previous)
