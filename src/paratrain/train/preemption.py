"""Stopping on a signal: on SIGTERM (a scheduler) or SIGINT (Ctrl-C, which the launcher
forwards) every rank finishes its step, a checkpoint is saved, and the run stops cleanly.
A second signal stops the process at once.

The signal reaches the ranks at different moments (or only some of them), so the decision
to stop is agreed once per step: a one-integer all-reduce (max) over the control group
(every rank, host-side gloo), after the step's own communication. Every rank then stops
after the same step. Asynchronous runs have no common step: they ask `signalled` (this
rank's flag, no communication) and let the parameter server decide (train/async_loop.py).
"""

from __future__ import annotations

import os
import signal
from typing import Any

import torch

from paratrain import comm

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StoppedAtOnce(Exception):
    """This rank was signalled and then lost its peers (a second signal ended them): the
    stop the user asked for, not an error to print. Exit status 128 + the signal."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(f"stopped at once by {signal_name}")
        self.status = 128 + signal.Signals[signal_name]


class Preemption:
    """Callable once per step, collectively: True when any rank has received a stop
    signal."""

    def __init__(self, control: comm.CommGroup) -> None:
        self.control = control
        self.requested_by: str | None = None  # the first stop signal's name
        self._previous: dict[int, Any] = {}
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    @property
    def requested(self) -> bool:
        return self.requested_by is not None

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.requested_by is None:
            self.requested_by = signal.Signals(signum).name
            return
        # A second one: end now, by the signal's default action (a handler that left the
        # default in place would meet a signal pending from before, which Python reports
        # as "ignored due to race condition").
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    def signalled(self) -> bool:
        """Whether this rank has received a stop signal; local, not collective."""
        return self.requested

    def __call__(self) -> bool:
        flag = torch.tensor([int(self.requested)], dtype=torch.int64, device="cpu")  # host-side
        comm.all_reduce(flag, self.control, op="max")
        return bool(flag.item())

    def close(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
