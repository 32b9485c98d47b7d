"""What one pipeline step keeps while its schedule runs (runtime.py): the tensors in
flight, keyed by (micro-batch, chunk) or by message, and the activation bytes they hold."""

from __future__ import annotations

import torch
from torch import nn

from paratrain import comm
from paratrain.parallel.pipeline.schedules import MessageKey
from paratrain.parallel.pipeline.split_backward import WeightGrad


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
        self.params: list[list[nn.Parameter]] = []  # per chunk, those that train (BI's)


def held_bytes(st: StepState) -> int:
    """Bytes of the storages saved for the backwards still to run, each storage once."""
    live: dict[int, int] = {}
    for storages in st.storages.values():
        live.update(storages)
    return sum(live.values())
