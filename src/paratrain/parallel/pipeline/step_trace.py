"""What one stage did in one step, recorded by the runtime from its own clock.

`time.perf_counter` is one clock for all processes of a machine, so the traces of
different ranks line up without any clock exchange (`train --trace`, `bench pp`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from paratrain.parallel.pipeline.schedules import COMPUTE, Action


@dataclass(frozen=True)
class Event:
    action: Action
    start: float  # time.perf_counter(): one clock for all processes of a machine
    end: float


@dataclass
class StepTrace:
    """What one stage did in one step, from its own timestamps only."""

    stage: int
    start: float
    end: float
    events: list[Event] = field(default_factory=list)
    peak_in_flight: int = 0  # most (micro-batch, chunk) forward graphs held at once
    peak_in_flight_bytes: int = 0  # most bytes saved for backward held at once
    # (micro-batch, chunk) -> bytes its forward saved for backward (saved-tensor hooks)
    activation_bytes: dict[tuple[int, int], int] = field(default_factory=dict)

    def busy(self) -> float:
        return sum(e.end - e.start for e in self.events if e.action.kind in COMPUTE)

    def bubble_fraction(self) -> float:
        """Measured idle fraction: time not computing (waiting, sending) over the step."""
        span = self.end - self.start
        return 1.0 - self.busy() / span if span > 0 else 0.0
