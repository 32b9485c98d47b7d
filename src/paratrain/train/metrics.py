"""What a training run reports: one `StepMetrics` per step, a `TrainResult` at the end, and
the timer that splits a step into data, compute and communication time."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from torch import nn

from paratrain.comm.ledger import Ledger
from paratrain.train.step import StepOutput

ROUTING_KEYS = ("expert_tokens_min", "expert_tokens_max", "dropped_fraction", "aux_loss")


@dataclass(frozen=True)
class StepMetrics:
    step: int
    loss: float
    lr: float
    tokens_per_s: float
    grad_norm: float
    step_s: float
    compute_s: float  # step time not spent waiting for communication or data
    comm_s: float  # time blocked in collectives (from the ledger)
    data_s: float  # time spent producing this step's batches
    skipped: bool = False  # non-finite gradient norm: no update
    compile_s: float = 0.0  # --compile: time spent compiling blocks, left out of step_s
    # Mixture of experts: expert_tokens_min/max, dropped_fraction, aux_loss (train/experts.py)
    routing: dict[str, float] | None = None

    def as_dict(self) -> dict[str, float]:
        """The fields, the routing's spread among them (absent for a dense model)."""
        fields = asdict(self)
        routing = fields.pop("routing") or {}
        return {**fields, **routing}

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> StepMetrics:
        """What `as_dict` wrote (a line of metrics.jsonl)."""
        fields = {k: v for k, v in row.items() if k not in ROUTING_KEYS}
        routing = {k: v for k, v in row.items() if k in ROUTING_KEYS}
        return cls(**fields, routing=routing or None)


@dataclass
class TrainResult:
    model: nn.Module  # the plain model (unwrapped), or this stage's chunks
    metrics: list[StepMetrics]
    val_loss: float
    extra: dict = field(default_factory=dict)  # model_state_bytes; async: staleness etc.
    engine: Any = None  # what computed the steps (replicas, runtime), for measurements
    optimizer: Any = None


class StepTimer:
    """One step's wall time, split by the moments the loop marks and the ledger's record of
    time spent blocked in collectives."""

    def __init__(self, ledger: Ledger, compiling: Callable[[], float] | None = None) -> None:
        self.ledger = ledger
        self.compiling = compiling or (lambda: 0.0)  # seconds spent compiling so far

    def start(self, step: int) -> None:
        self.ledger.step = step + 1  # named in hang reports
        self._start = time.perf_counter()
        self._waited = self.ledger.wait_s()
        self._compiled = self.compiling()

    def data_done(self) -> None:
        self._data_done = time.perf_counter()

    def busy_s(self) -> float:
        """Compute time so far: since the data was ready, less time blocked in collectives."""
        return time.perf_counter() - self._data_done - self.comm_s()

    def comm_s(self) -> float:
        return self.ledger.wait_s() - self._waited

    def finish(self, step: int, out: StepOutput, lr: float) -> StepMetrics:
        # Compiling happens inside the first step's compute; it is reported on its own so
        # that step_s and tokens_per_s measure the compiled model from the first step on.
        compile_s = self.compiling() - self._compiled
        end = time.perf_counter() - compile_s
        step_s, comm_s = end - self._start, self.comm_s()
        return StepMetrics(
            step=step + 1,
            loss=out.loss,
            lr=lr,
            tokens_per_s=out.tokens / step_s,
            grad_norm=out.grad_norm,
            step_s=step_s,
            compute_s=end - self._data_done - comm_s,
            comm_s=comm_s,
            data_s=self._data_done - self._start,
            skipped=out.skipped,
            compile_s=compile_s,
            routing=out.routing,
        )
