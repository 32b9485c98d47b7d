"""What one pipeline step keeps while its schedule runs (runtime.py): the tensors in
flight, keyed by (micro-batch, chunk) or by message, and the activation bytes they hold."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from paratrain import comm
from paratrain.parallel.pipeline.batches import Batch
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
        # receives in flight, by message key: (handle, peer, the call that carries it)
        self.posted: dict[MessageKey, tuple[comm.Handle[torch.Tensor], int, int]] = {}
        # sends in flight: (peer, the call that carries it, handle); each holds its tensor
        self.sends: list[tuple[int, int, comm.Handle[torch.Tensor]]] = []
        self.calls = 0  # group calls issued so far in this step
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

    def add_call(
        self,
        call: Batch,
        sent: list[comm.Handle[torch.Tensor]],
        received: list[comm.Handle[torch.Tensor]],
    ) -> None:
        """A group call in flight: its sends by peer and call, its receives by key."""
        self.calls += 1
        for (peer, _), handle in zip(call.sends, sent, strict=True):
            self.sends.append((peer, self.calls, handle))
        for (peer, key), handle in zip(call.recvs, received, strict=True):
            self.posted[key] = (handle, peer, self.calls)

    def receive(self, key: MessageKey) -> torch.Tensor:
        """Wait for a posted receive, then let go of the sends it shows complete."""
        handle, peer, call = self.posted.pop(key)
        tensor = handle.wait()
        self._release_sends(peer, call)
        return tensor

    def _release_sends(self, peer: int, call: int) -> None:
        """Wait for the sends to `peer` in this step's calls up to `call`, and let go of
        what they hold (a forward's output, a backward's input gradient), once a receive
        from `peer` carried by `call` has arrived. `peer` issued that call to send it, so it
        has posted the receives of every earlier call with us (the calls of two neighbours
        match exactly, batches.py): each of those sends completes without waiting for
        anything more. Held to the step's end instead, they grew with the micro-batches: K
        outputs on the first stage where 1F1B keeps S in flight."""
        still = []
        for send in self.sends:
            if send[0] == peer and send[1] <= call:
                send[2].wait()
            else:
                still.append(send)
        self.sends = still


def held_bytes(st: StepState) -> int:
    """Bytes of the storages saved for the backwards still to run, each storage once."""
    live: dict[int, int] = {}
    for storages in st.storages.values():
        live.update(storages)
    return sum(live.values())
