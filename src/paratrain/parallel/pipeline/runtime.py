"""Execute any checked schedule on one stage: one runtime for every schedule.

The stage walks its action list in order. Activations and their gradients travel through
`paratrain.comm` point to point, so the ledger counts every byte. Every message of a step
has the shape (b, T, hidden) known to all stages from the micro-batches and the model
width, so receive buffers are allocated without any handshake.

Sends are posted (isend) and waited for at the end of the step; a receive blocks until
its message is there. Messages between two stages arrive in the sender's order, which need
not be the order this stage uses them (interleaved schedules with S = 2 mix activations and
gradients on one link), so receives are posted in the *sender's* order, read from the
schedule, and a message that arrives early waits in its buffer until its RECV action.
This is exactly the model the checker simulates, so a checked schedule cannot hang here.
Each RECV also keeps the next receives from the same stage posted (`receives_ahead`; by
default all of the step's, as torch's pipelining holds a receive buffer per micro-batch):
gloo writes a message only into a posted receive, so a message then arrives during the
compute in between rather than inside its RECV. The cost is the posted buffers, one
(b, T, hidden) activation or gradient each.

Activation memory is measured, not derived from the schedule: each training forward runs
under an `ActivationMeter` (saved-tensor pack hook), which records the storages autograd
keeps for that (micro-batch, chunk)'s backward. They count as held from the forward until
the backward that frees them (`B`, or `BW` when split: the weight gradient still needs the
layer inputs); the bytes held are those of the union of the storages of the pairs in
flight, so a storage shared by two micro-batches counts once. `measure_activations=False`
skips the meter (and its Python call per saved tensor) when nobody reads those bytes.

Split backward (ZB-H1): `BI` computes dL/dx and keeps each weight consumer's output
gradient, `BW` computes the weight gradients from those, so no node's work is done twice
(split_backward.py).

Loss: the last virtual stage computes each micro-batch's mean token loss and backpropagates
loss / K. All micro-batches hold the same number of tokens, so the gradients accumulated
over the K micro-batches equal those of one step on the whole batch. Terms of the loss that
other stages compute (`stage_loss`: a mixture of experts' balancing losses) ride on their
outputs' backward, also / K (stage_loss.py), and the step's loss is then the sum over the
stages rather than the last stage's.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch
from torch import nn

from paratrain import comm
from paratrain.measure.activations import ActivationMeter
from paratrain.parallel.pipeline.check import check_schedule
from paratrain.parallel.pipeline.schedules import (
    BI,
    BW,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    B,
    F,
    Schedule,
    forward_only,
    message_key,
    virtual_stage,
)
from paratrain.parallel.pipeline.split_backward import backward_input
from paratrain.parallel.pipeline.stage_loss import StageLoss, attach
from paratrain.parallel.pipeline.step_state import StepState, held_bytes
from paratrain.parallel.pipeline.step_trace import Event, StepTrace


def whole_rows(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of T + 1 ids -> (inputs, targets), (b, T) each; padding (-100) reads id 0."""
    return batch[:, :-1].clamp(min=0), batch[:, 1:]


class PipelineRuntime:
    """Runs `schedule` for this rank's stage (`group.rank`) of the pp `group`.

    `chunks[c]` is the module of virtual stage c * S + stage (from split_into_stages).
    `run_step` accumulates gradients into `.grad` (the caller zeroes them and steps the
    optimizer); `run_forward` evaluates. Both return the mean loss on every stage.
    """

    def __init__(
        self,
        chunks: list[nn.Module],
        schedule: Schedule,
        group: comm.CommGroup,
        hidden_size: int,
        dtype: torch.dtype = torch.float32,
        measure_activations: bool = True,
        split: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] = whole_rows,
        receives_ahead: int | None = None,
        stage_loss: StageLoss | None = None,
    ) -> None:
        if group.size != schedule.num_stages:
            raise ValueError(
                f"pp group has {group.size} ranks, schedule {schedule.name} has "
                f"{schedule.num_stages} stages; they must be equal"
            )
        if len(chunks) != schedule.chunks:
            raise ValueError(f"{len(chunks)} chunks given, schedule has {schedule.chunks}")
        check_schedule(schedule)  # proven complete and deadlock-free before it runs
        self.chunks, self.schedule, self.group = chunks, schedule, group
        self.stage, self.hidden_size, self.dtype = group.rank, hidden_size, dtype
        self.device = next(chunks[0].parameters()).device  # where activations arrive
        # The saved-tensor meter costs a Python call per saved tensor (a tenth of a
        # forward here); without it the traces' activation bytes stay 0.
        self.measure_activations = measure_activations
        # A micro-batch -> (inputs, targets) of this rank's tokens: all of them, or under
        # context parallelism its chunks, so that stages pass sequence-sharded activations.
        self.split = split
        # Receives kept posted per neighbour beyond the one waited for (None: every one of
        # the step's). One ahead measured 1.033 (1F1B) and 1.038 (interleaved) of torch's
        # step in bench pp, all of them 0.949-0.964 and 0.925-0.929 (docs/benchmarks.md).
        if receives_ahead is not None and receives_ahead < 1:
            raise ValueError(f"receives_ahead {receives_ahead}: at least 1, or None for all")
        self.receives_ahead = receives_ahead
        # Terms of the loss a chunk short of the last computes (same on every stage: it
        # decides the step's last collective). The last chunk's forward includes its own.
        self.stage_loss = stage_loss
        self.last_trace: StepTrace | None = None  # the last step or evaluation
        self.last_train_trace: StepTrace | None = None  # the last run_step
        self._channel_orders: dict[tuple[str, int], dict[int, list[tuple]]] = {}

    # -- public API -----------------------------------------------------------------
    def run_step(self, micro_batches: list[torch.Tensor]) -> float:
        """Forward and backward of all K micro-batches (rows of T + 1 token ids each)."""
        if len(micro_batches) != self.schedule.num_microbatches:
            raise ValueError(
                f"{len(micro_batches)} micro-batches given, schedule {self.schedule.name} "
                f"was built for K={self.schedule.num_microbatches}"
            )
        return self._execute(self.schedule, micro_batches, train=True)

    @torch.no_grad()
    def run_forward(self, micro_batches: list[torch.Tensor]) -> float:
        """Mean loss over the micro-batches with the forward-only schedule (evaluation)."""
        sch = forward_only(self.schedule.num_stages, len(micro_batches), self.schedule.chunks)
        modes = [c.training for c in self.chunks]
        for c in self.chunks:
            c.eval()
        try:
            return self._execute(sch, micro_batches, train=False)
        finally:
            for c, mode in zip(self.chunks, modes, strict=True):
                c.train(mode)

    def parameters(self) -> list[nn.Parameter]:
        return [p for chunk in self.chunks for p in chunk.parameters()]

    # -- execution ------------------------------------------------------------------
    def _execute(self, schedule: Schedule, micro_batches: list[torch.Tensor], train: bool) -> float:
        st = StepState(micro_batches, train, self.device)
        st.params = [[p for p in c.parameters() if p.requires_grad] for c in self.chunks]
        rows, tokens = self.split(micro_batches[0])[0].shape
        self._shape = (rows, tokens, self.hidden_size)  # (b, T, C) of every message
        self._num_micro = len(micro_batches)
        trace = StepTrace(self.stage, time.perf_counter(), 0.0)
        handlers = {F: self._forward, B: self._backward, BI: self._backward_input,
                    BW: self._backward_weight, SEND_F: self._send, SEND_B: self._send,
                    RECV_F: self._recv, RECV_B: self._recv}  # fmt: skip
        for a in schedule.stages[self.stage]:
            start = time.perf_counter()
            handlers[a.kind](a, st, schedule)
            trace.events.append(Event(a, start, time.perf_counter()))
            trace.peak_in_flight = max(trace.peak_in_flight, len(st.saved))
            if a.kind == F and st.train:  # only a forward adds to what is held
                key = (a.microbatch, a.chunk)
                trace.activation_bytes[key] = sum(st.storages[key].values())
                held = held_bytes(st)
                trace.peak_in_flight_bytes = max(trace.peak_in_flight_bytes, held)
        for handle in st.sends:
            handle.wait()
        trace.end = time.perf_counter()
        self.last_trace = trace
        if train:
            self.last_train_trace = trace
        loss = st.loss_sum if train else st.loss_sum / self._num_micro
        # The loss lives on the last stage (it owns the last virtual stage); one scalar
        # broadcast so that every stage can log it, or summed when stages hold terms of it.
        if self.stage_loss is not None:
            return float(comm.all_reduce(loss, self.group, op="sum"))
        return float(comm.broadcast(loss, self.group, src=self.group.size - 1))

    def _vs(self, a: Action) -> int:
        return virtual_stage(self.stage, a.chunk, self.schedule.num_stages)

    def _forward(self, a: Action, st: StepState, sch: Schedule) -> None:
        vs, last = self._vs(a), sch.num_virtual_stages - 1
        inputs, targets = self.split(st.micro_batches[a.microbatch])
        if vs == 0:
            x = inputs  # (b, T) ids; padding (-100) reads id 0, unscored
        else:
            x = st.inbox.pop(("act", a.microbatch, a.chunk))  # (b, T, C)
            x.requires_grad_(st.train)
        chunk = self.chunks[a.chunk]
        meter = ActivationMeter(chunk) if st.train and self.measure_activations else None
        with meter or contextlib.nullcontext():
            if vs == last:
                loss = chunk(x, targets)  # mean over this micro-batch's tokens
                st.loss_sum += loss.detach() / self._num_micro if st.train else loss.detach()
                y = loss / self._num_micro  # so the K backwards sum to one big batch's grad
            else:
                y = chunk(x)  # (b, T, C)
                term = self.stage_loss(chunk) if st.train and self.stage_loss else None
                if term is not None:
                    st.loss_sum += term.detach() / self._num_micro
                    y = attach(y, term / self._num_micro)
        if vs != last:
            self._hand_over(st, ("act", a.microbatch, a.chunk), y.detach(), +1)
        if st.train:
            st.saved[(a.microbatch, a.chunk)] = (x, y)
            st.storages[(a.microbatch, a.chunk)] = meter.storages if meter else {}

    def _hand_over(self, st: StepState, key: tuple, tensor: torch.Tensor, step: int) -> None:
        """Queue for the SEND action, or with one stage pass straight to the next chunk."""
        if self.schedule.num_stages > 1:
            st.outbox[key] = tensor
        else:
            st.inbox[(key[0], key[1], key[2] + step)] = tensor

    def _output_grad(self, a: Action, st: StepState) -> torch.Tensor | None:
        last = self.schedule.num_virtual_stages - 1
        return None if self._vs(a) == last else st.inbox.pop(("grad", a.microbatch, a.chunk))

    def _backward(self, a: Action, st: StepState, sch: Schedule) -> None:
        x, y = st.saved.pop((a.microbatch, a.chunk))
        del st.storages[(a.microbatch, a.chunk)]
        torch.autograd.backward(y, self._output_grad(a, st))
        if self._vs(a) > 0:
            self._hand_over(st, ("grad", a.microbatch, a.chunk), x.grad, -1)

    def _backward_input(self, a: Action, st: StepState, sch: Schedule) -> None:
        """Only dL/dx; what BW needs is kept (arXiv:2401.10241, section 2; split_backward.py)."""
        x, y = st.saved[(a.microbatch, a.chunk)]
        gx, weight_grad = backward_input(y, self._output_grad(a, st), x, st.params[a.chunk])
        st.weight_grad[(a.microbatch, a.chunk)] = weight_grad
        # BW needs only what BI kept: the nodes above the last weight (the loss's
        # log-softmax output, on the last stage) go now.
        st.saved[(a.microbatch, a.chunk)] = (x, y.detach())
        if self._vs(a) > 0:  # the first virtual stage has no input gradient to send
            self._hand_over(st, ("grad", a.microbatch, a.chunk), gx, -1)

    def _backward_weight(self, a: Action, st: StepState, sch: Schedule) -> None:
        """The deferred dL/dW from BI's kept gradients, accumulated into .grad."""
        del st.saved[(a.microbatch, a.chunk)], st.storages[(a.microbatch, a.chunk)]
        st.weight_grad.pop((a.microbatch, a.chunk)).run()

    def _send(self, a: Action, st: StepState, sch: Schedule) -> None:
        dst, _ = message_key(a.kind, a.microbatch, a.chunk, self.stage, sch.num_stages)
        kind = "act" if a.kind == SEND_F else "grad"
        tensor = st.outbox.pop((kind, a.microbatch, a.chunk))
        st.sends.append(comm.isend(tensor.contiguous(), self.group, dst))

    def _recv(self, a: Action, st: StepState, sch: Schedule) -> None:
        _, key = message_key(a.kind, a.microbatch, a.chunk, self.stage, sch.num_stages)
        order = self._channel_order(sch, a.peer)
        # Post receives in the sender's order up to and including the one needed now.
        while key not in st.posted:
            if not self._post_next(st, a.peer, order):
                raise RuntimeError(f"stage {self.stage}: {a} is never sent by stage {a.peer}")
        st.inbox[key] = st.posted.pop(key).wait()
        st.received[a.peer] = st.received.get(a.peer, 0) + 1
        # And the next ones: gloo writes a message only into a posted receive, so posted
        # now they travel while this stage computes instead of inside the next RECVs.
        ahead = self.receives_ahead if self.receives_ahead is not None else len(order)
        while st.next_expected[a.peer] - st.received[a.peer] < ahead:
            if not self._post_next(st, a.peer, order):
                break

    def _post_next(self, st: StepState, src: int, order: list[tuple]) -> bool:
        """Post the receive of `src`'s next message to this stage; False after its last."""
        i = st.next_expected.get(src, 0)
        if i >= len(order):
            return False
        buf = torch.empty(self._shape, dtype=self.dtype, device=self.device)
        st.posted[order[i]] = comm.irecv(buf, self.group, src)
        st.next_expected[src] = i + 1
        return True

    def _channel_order(self, sch: Schedule, src: int) -> list[tuple]:
        """Keys of the messages `src` sends to this stage, in its send order."""
        cache = self._channel_orders.setdefault((sch.name, sch.num_microbatches), {})
        if src not in cache:
            keys = []
            for a in sch.stages[src]:
                if a.kind in (SEND_F, SEND_B):
                    dst, key = message_key(a.kind, a.microbatch, a.chunk, src, sch.num_stages)
                    if dst == self.stage:
                        keys.append(key)
            cache[src] = keys
        return cache[src]
