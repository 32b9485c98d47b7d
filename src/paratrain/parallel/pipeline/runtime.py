"""Execute any checked schedule on one stage: one runtime for every schedule.

The stage walks its action list in order. Activations and their gradients travel through
`paratrain.comm` point to point, so the ledger counts every byte. Every message of a step
has the shape (b, T, hidden) known to all stages from the micro-batches and the model
width, so receive buffers are allocated without any handshake.

Messages travel in the group calls that batches.py places (`plan_calls`): two
neighbouring stages exchange, in one `batch_isend_irecv` each, everything either has
computed for the other, in its send order, so that the two calls match exactly, as
NCCL's streams need (a receive posted alone ahead of a send deadlocks there, issue 28).
A call is issued before the action it is placed at; its receives are waited for at
their RECV (a message that arrives earlier waits in its buffer), its sends as soon as a
receive from the same peer shows them complete (StepState `receive`), the rest at the
step's end. SEND and RECV actions move no data themselves. check_schedule proves the
calls complete under NCCL's stream semantics (stream_check.py) as well as under gloo's.

Activation memory is measured, not derived from the schedule: each training forward runs
under the `meter` given (measure/activations.py's `ActivationMeter`, a saved-tensor pack
hook, handed in by the caller: this package imports no instrument), which records the
storages autograd keeps for that (micro-batch, chunk)'s backward. They count as held from
the forward until the backward that frees them (`B`, or `BW` when split: the weight
gradient still needs the layer inputs); the bytes held are those of the union of the
storages of the pairs in flight, so a storage shared by two micro-batches counts once.
Without a meter (the default) the traces' activation bytes stay 0 and no Python call per
saved tensor is paid.

Split backward (ZB-H1): `BI` computes dL/dx and keeps each weight consumer's output
gradient, `BW` computes the weight gradients from those, so no node's work is done twice
(split_backward.py).

Loss: the last virtual stage computes each micro-batch's mean token loss and backpropagates
it times the micro-batch's share of the objective (StepState.share: 1 / K, or the weight
the engine gives, its target tokens). Terms of the loss that other stages compute
(`stage_loss`: a mixture of experts' balancing losses) ride on their outputs' backward
with the same factor (stage_loss.py); the step's loss is then summed over the stages.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch import nn

from paratrain import comm
from paratrain.parallel.pipeline.batches import Batch, plan_calls
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
    MessageKey,
    Schedule,
    forward_only,
    message_key,
    virtual_stage,
)
from paratrain.parallel.pipeline.split_backward import backward_input
from paratrain.parallel.pipeline.stage_loss import StageLoss, attach
from paratrain.parallel.pipeline.step_state import SavedTensorMeter, StepState, held_bytes
from paratrain.parallel.pipeline.step_trace import Event, StepTrace
from paratrain.token_rows import model_keywords, split_rows


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
        meter: Callable[[nn.Module], SavedTensorMeter] | None = None,
        split: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] = split_rows,
        stage_loss: StageLoss | None = None,
        keywords: Callable[[torch.Tensor], dict[str, torch.Tensor]] = model_keywords,
        one_backward: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext,
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
        self.meter = meter  # a Python call per saved tensor; without it traces show no bytes
        # A micro-batch -> (inputs, targets) of this rank's tokens: all of them, or under
        # context parallelism its chunks, so that stages pass sequence-sharded activations.
        self.split = split
        # A micro-batch -> the chunks' other arguments: packed documents' positions, which
        # every stage's attention needs (token_rows.model_keywords).
        self.keywords = keywords
        # Terms of the loss a chunk short of the last computes (same on every stage: it
        # decides the step's last collective). The last chunk's forward includes its own.
        self.stage_loss = stage_loss
        self.one_backward = one_backward  # around a zero-bubble weight pass (sync_switch.py)
        self.last_trace: StepTrace | None = None  # the last step or evaluation
        self.last_train_trace: StepTrace | None = None  # the last run_step
        self._calls: dict[Schedule, dict[int, list[Batch]]] = {}  # per action index

    # -- public API -----------------------------------------------------------------
    def run_step(
        self, micro_batches: list[torch.Tensor], weights: list[float] | None = None
    ) -> float:
        """Forward and backward of all K micro-batches (rows of T + 1 token ids each): the
        gradients and the loss of the mean of their mean losses, or with `weights` of the
        sum of each mean loss times its weight (the engine's: its target tokens)."""
        if len(micro_batches) != self.schedule.num_microbatches:
            raise ValueError(
                f"{len(micro_batches)} micro-batches given, schedule {self.schedule.name} "
                f"was built for K={self.schedule.num_microbatches}"
            )
        return self._execute(self.schedule, micro_batches, train=True, weights=weights)

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
    def _execute(
        self,
        schedule: Schedule,
        micro_batches: list[torch.Tensor],
        train: bool,
        weights: list[float] | None = None,
    ) -> float:
        st = StepState(micro_batches, train, self.device)
        st.weights = weights
        st.params = [[p for p in c.parameters() if p.requires_grad] for c in self.chunks]
        rows, tokens = self.split(micro_batches[0])[0].shape
        self._shape = (rows, tokens, self.hidden_size)  # (b, T, C) of every message
        trace = StepTrace(self.stage, time.perf_counter(), 0.0)
        handlers = {F: self._forward, B: self._backward, BI: self._backward_input,
                    BW: self._backward_weight, SEND_F: self._send, SEND_B: self._send,
                    RECV_F: self._recv, RECV_B: self._recv}  # fmt: skip
        calls = self._calls_of(schedule)
        actions = schedule.stages[self.stage]
        for i, a in enumerate(actions):
            start = time.perf_counter()
            for call in calls.get(i, ()):
                self._issue(call, st)
            handlers[a.kind](a, st, schedule)
            trace.events.append(Event(a, start, time.perf_counter()))
            trace.peak_in_flight = max(trace.peak_in_flight, len(st.saved))
            if a.kind == F and st.train:  # only a forward adds to what is held
                key = (a.microbatch, a.chunk)
                trace.activation_bytes[key] = sum(st.storages[key].values())
                held = held_bytes(st)
                trace.peak_in_flight_bytes = max(trace.peak_in_flight_bytes, held)
        for call in calls.get(len(actions), ()):
            self._issue(call, st)
        for _, _, handle in st.sends:  # those no later receive has shown complete
            handle.wait()
        trace.end = time.perf_counter()
        self.last_trace = trace
        if train:
            self.last_train_trace = trace
        loss = st.loss_sum if train else st.loss_sum / len(micro_batches)
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
        keywords = self.keywords(st.micro_batches[a.microbatch])
        if vs == 0:
            x = inputs  # (b, T) ids; padding (-100) reads id 0, unscored
        else:
            x = st.inbox.pop(("act", a.microbatch, a.chunk))  # (b, T, C)
            x.requires_grad_(st.train)
        chunk = self.chunks[a.chunk]
        meter = self.meter(chunk) if st.train and self.meter is not None else None
        share = st.share(a.microbatch)
        with meter or contextlib.nullcontext():
            if vs == last:
                loss = chunk(x, st.scored(a.microbatch, targets), **keywords)  # token mean
                st.loss_sum += share(loss.detach()) if st.train else loss.detach()
                y = share(loss)  # so the K backwards sum to the step's objective's gradient
            else:
                y = chunk(x, **keywords)  # (b, T, C)
                term = self.stage_loss(chunk) if st.train and self.stage_loss else None
                if term is not None:
                    st.loss_sum += share(term.detach())
                    y = attach(y, share(term))
        if vs != last:
            self._hand_over(st, ("act", a.microbatch, a.chunk), y.detach(), +1)
        if st.train:
            st.saved[(a.microbatch, a.chunk)] = (x, y)
            st.storages[(a.microbatch, a.chunk)] = meter.storages if meter else {}

    def _hand_over(self, st: StepState, key: MessageKey, t: torch.Tensor | None, step: int) -> None:
        """Queue `t` for its group call, by the receiver's key (message_key), or with one
        stage pass it straight to the next chunk."""
        assert t is not None, key  # past the first virtual stage, x has a gradient
        s_ = self.schedule.num_stages
        if s_ > 1:
            send = SEND_F if key[0] == "act" else SEND_B
            st.outbox[message_key(send, key[1], key[2], self.stage, s_)[1]] = t
        else:
            st.inbox[(key[0], key[1], key[2] + step)] = t

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
        with self.one_backward():  # its calls, one backward to the wrappers
            st.weight_grad.pop((a.microbatch, a.chunk)).run()

    def _send(self, a: Action, st: StepState, sch: Schedule) -> None:
        """Nothing to do: the message leaves in the group call after it (_issue)."""

    def _recv(self, a: Action, st: StepState, sch: Schedule) -> None:
        _, key = message_key(a.kind, a.microbatch, a.chunk, self.stage, sch.num_stages)
        if key not in st.posted:  # plan_calls posts every receive by its RECV
            raise RuntimeError(f"stage {self.stage}: {a} was never posted")
        st.inbox[key] = st.receive(key)

    def _issue(self, call: Batch, st: StepState) -> None:
        """One group call, in flight: its receives are waited for at their RECV, its sends
        when a later receive from their peer arrives (StepState.receive), or at the step's end."""
        sends = [(st.outbox.pop(key), peer) for peer, key in call.sends]
        buffers = [
            torch.empty(self._shape, dtype=self.dtype, device=self.device) for _ in call.recvs
        ]
        received, sent = comm.post(
            self.group,
            sends,
            [(buf, peer) for buf, (peer, _) in zip(buffers, call.recvs, strict=True)],
        )
        st.add_call(call, sent, received)

    def _calls_of(self, schedule: Schedule) -> dict[int, list[Batch]]:
        """This stage's group calls by the index of the action they go before."""
        if schedule not in self._calls:
            by_index: dict[int, list[Batch]] = {}
            for call in plan_calls(schedule)[self.stage]:
                by_index.setdefault(call.at, []).append(call)
            self._calls[schedule] = by_index
        return self._calls[schedule]
