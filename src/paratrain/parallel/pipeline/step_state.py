"""What one pipeline step keeps while its schedule runs (runtime.py): the tensors in
flight, keyed by (micro-batch, chunk) or by message, and the activation bytes they hold."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from paratrain import comm
from paratrain.parallel.pipeline.schedules import MessageKey
from paratrain.parallel.pipeline.split_backward import WeightGrad


class SavedTensorMeter(Protocol):
    """What the runtime reads of a meter over one chunk's forward: the storages autograd
    saved for backward, data_ptr -> bytes (measure/activations.py: ActivationMeter)."""

    storages: dict[int, int]

    def __enter__(self) -> Any: ...

    def __exit__(self, *exc: Any) -> Any: ...


class StepState:
    """Tensors in flight during one step, keyed by (micro-batch, chunk) or message key."""

    def __init__(
        self, micro_batches: list[torch.Tensor], train: bool, device: torch.device
    ) -> None:
        self.micro_batches, self.train = micro_batches, train
        self.inbox: dict[MessageKey, torch.Tensor] = {}  # received (or local) inputs, grads
        self.outbox: dict[MessageKey, torch.Tensor] = {}  # computed, waiting for their SEND
        self.saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (x, y)
        self.storages: dict[tuple[int, int], dict[int, int]] = {}  # per saved: ptr -> bytes
        self.weight_grad: dict[tuple[int, int], WeightGrad] = {}  # BW's work, kept by BI
        # receives in flight, by message key
        self.posted: dict[MessageKey, comm.Handle[torch.Tensor]] = {}
        self.sends: list[comm.Handle[torch.Tensor]] = []
        self.loss_sum = torch.zeros((), device=device)
        # Each micro-batch's weight in the objective (its target tokens), or None: 1 / K each
        self.weights: list[float] | None = None

    def share(self, microbatch: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """A micro-batch's part of the step's objective: a value times its weight, or / K
        (micro-batches of equal token counts: the K backwards sum to the whole batch's)."""
        if self.weights is None:
            k = len(self.micro_batches)
            return lambda value: value / k
        weight = self.weights[microbatch]
        return lambda value: value * weight

    def scored(self, microbatch: int, targets: torch.Tensor) -> torch.Tensor:
        """The targets to score; a training micro-batch of weight 0 (no target: all
        IGNORE_INDEX) scores token 0 instead, a finite loss that its weight zeroes."""
        if self.train and self.weights is not None and self.weights[microbatch] == 0:
            return targets.clamp(min=0)
        return targets
        self.params: list[list[nn.Parameter]] = []  # per chunk, those that train (BI's)


def held_bytes(st: StepState) -> int:
    """Bytes of the storages saved for the backwards still to run, each storage once."""
    live: dict[int, int] = {}
    for storages in st.storages.values():
        live.update(storages)
    return sum(live.values())
