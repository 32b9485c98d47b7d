"""What the parameter server keeps and reports (async_sgd.py runs it): its state, which a
checkpoint stores beside the model and the optimizer, and a record of every update."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ServerState:
    """Where the server stands: what a checkpoint keeps beside the model and the optimizer.

    Batch indices are handed out in order (next_batch), one at a time per worker; with no
    staleness bound every index below next_batch has been applied exactly once or is
    assigned to a worker right now. A resumed server hands each worker its assigned batch
    again, so no batch is applied twice or skipped (a worker's in-flight gradient is lost
    with the process; its batch is redone).

    version: updates applied so far (also the 0-based index of the next one).
    next_batch: the lowest batch index never handed out.
    assigned: worker (group rank) -> the batch it computes now or next, handed out and not
        yet applied.
    dc_mean_square: DC-ASGD-a's mean square of the applied gradients (None: none yet).
    """

    version: int
    next_batch: int
    assigned: dict[int, int]
    dc_mean_square: torch.Tensor | None = None

    @classmethod
    def fresh(cls, workers: list[int]) -> ServerState:
        """Before the first update: worker i of the list computes batch i."""
        return cls(0, len(workers), {w: i for i, w in enumerate(workers)})

    def hand_out(self, worker: int) -> int:
        self.assigned[worker] = self.next_batch
        self.next_batch += 1
        return self.assigned[worker]


@dataclass(frozen=True)
class Update:
    index: int  # 0-based count of applied updates
    worker: int  # group rank of the worker
    staleness: int  # updates applied between the worker's pull and this push
    batch: int
    grad_norm: float  # of the applied (corrected) gradient, before clipping
    loss: float
    tokens: float
    time_s: float  # since the server started


@dataclass
class ServerReport:
    updates: list[Update] = field(default_factory=list)
    dropped: int = 0  # gradients refused by the staleness bound
    compensation: str = "none"  # DC-ASGD as applied: "none", "constant" or "adaptive"

    def pushes_by_worker(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for u in self.updates:
            counts[u.worker] = counts.get(u.worker, 0) + 1
        return counts
