"""Asynchronous data parallelism: a parameter server and workers that never wait for each other.

Rank 0 of the group holds the master parameters and the optimizer. Each worker pulls the
parameters, computes a gradient on its own batch and pushes it; the server applies every
gradient as it arrives and answers that worker alone with fresh parameters and its next
batch. A gradient computed on parameters that are `s` updates old has staleness `s`
(seeds, 9.2: Hogwild!/parameter-server asynchronous SGD, Dean et al. 2012).

Delay compensation (DC-ASGD) corrects a stale gradient on the server (dc_asgd.py).
A staleness bound drops gradients older than the bound (the worker then gets fresh
parameters and recomputes), trading wasted work for freshness.

Messages (all through paratrain.comm point-to-point):
    worker -> server: header float64 [pulled_version, batch_index, loss, tokens, stop], grad
    server -> worker: header float64 [version, next_batch_index or -1 to stop], params
`stop` is 1 when the worker has been asked to stop (SIGTERM): the workers are never in
lockstep, so nothing is agreed collectively; the server alone decides, and answers each
worker's next push with -1 (train/async_loop.py stops at a step boundary).
Headers are host-side and go over `control`, a gloo group of the same ranks: the server
takes them from whichever worker pushes first (`_Inbox`), which NCCL cannot do. Parameters
and gradients then go over `group` (NCCL on GPUs), between the two ranks the header named.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import torch
from torch import nn

from paratrain import comm
from paratrain.parallel.data_parallel.async_state import ServerReport, ServerState, Update
from paratrain.parallel.data_parallel.dc_asgd import DelayCompensation

STOP = -1.0
_Arrival = tuple[int, list[float] | None, BaseException | None]  # worker, header, error


def _check_same_ranks(group: comm.CommGroup, control: comm.CommGroup) -> None:
    if control.ranks != group.ranks:
        raise ValueError(
            f"async SGD: the control group {control.ranks} must hold the ranks of "
            f"{group.name} {group.ranks}, in the same order"
        )


def _flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _load_flat(model: nn.Module, flat: torch.Tensor) -> None:
    offset = 0
    for p in model.parameters():
        p.data.copy_(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()


def _set_grads(model: nn.Module, flat: torch.Tensor) -> None:
    offset = 0
    for p in model.parameters():
        p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
        offset += p.numel()


class _Inbox:
    """The workers' push headers, taken in the order they arrive.

    Gloo's receive from any rank would do, but when a worker dies it waits out its whole
    timeout, while a receive from one rank fails as soon as that rank's connection closes.
    So one receive is posted per worker and waited on by a (daemon) thread of its own,
    which queues the header as it arrives; a dead worker's failure reaches the server at
    once, so that the launcher restarts the run (or brings it down) without a timeout.
    """

    def __init__(self, control: comm.CommGroup, workers: list[int]) -> None:
        self.control = control
        self.arrived: queue.Queue[_Arrival] = queue.Queue()
        for w in workers:
            self.expect(w)

    def expect(self, worker: int) -> None:
        """Post the receive of `worker`'s next header."""
        header = torch.empty(5, dtype=torch.float64, device="cpu")  # host-side, over control
        handle = comm.irecv(header, self.control, worker)
        waiter = threading.Thread(
            target=self._wait, args=(worker, handle), name="paratrain-inbox", daemon=True
        )
        waiter.start()

    def _wait(self, worker: int, handle: comm.Handle[torch.Tensor]) -> None:
        try:
            self.arrived.put((worker, handle.wait().tolist(), None))
        except Exception as e:  # the server's thread raises it
            self.arrived.put((worker, None, e))

    def next(self) -> tuple[int, list[float]]:
        """The worker whose header came first, and that header; a worker's failure raises."""
        worker, header, error = self.arrived.get()
        if error is not None:
            raise error
        assert header is not None  # arrived without an error
        return worker, header


class ParameterServer:
    """What the server keeps between messages: its state (version, batches), what each
    worker last pulled, the report of every update since it started, and whether a worker
    has asked to stop."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        groups: tuple[comm.CommGroup, comm.CommGroup],
        set_lr: Callable[[int], None],
        clip: Callable[[], float],
        compensate: DelayCompensation,
        state: ServerState,
    ) -> None:
        self.model, self.optimizer = model, optimizer
        self.group, self.control = groups
        self.set_lr, self.clip, self.compensate = set_lr, clip, compensate
        self.state = state
        compensate.mean_square = state.dc_mean_square
        self.pulled: dict[int, torch.Tensor] = {}  # worker -> the parameters it was sent
        self.report = ServerReport(compensation=compensate.mode if compensate.lam else "none")
        self.stop_asked = False  # a worker's push said it was asked to stop
        self.start = time.perf_counter()

    def reply(self, worker: int, batch: float) -> None:
        """Send the version and the next batch index; unless STOP, the parameters too."""
        version = float(self.state.version)
        header = torch.tensor([version, batch], dtype=torch.float64, device="cpu")
        comm.send(header, self.control, worker)
        if batch != STOP:
            self.pulled[worker] = _flat_params(self.model)
            comm.send(self.pulled[worker], self.group, worker)

    def apply(self, worker: int, grad: torch.Tensor, header: list[float], staleness: int) -> None:
        """Correct the pushed gradient for its delay, clip it and take one optimizer step."""
        _, batch, loss, tokens, _ = header
        index = self.state.version
        self.set_lr(index)
        grad = self.compensate(grad, _flat_params(self.model), self.pulled[worker])
        self.state.dc_mean_square = self.compensate.mean_square
        _set_grads(self.model, grad)
        norm = self.clip()
        self.optimizer.step()
        self.state.version += 1
        elapsed = time.perf_counter() - self.start
        self.report.updates.append(
            Update(index, worker, staleness, int(batch), norm, loss, tokens, elapsed)
        )


def serve(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    group: comm.CommGroup,
    control: comm.CommGroup,
    total_updates: int,
    set_lr: Callable[[int], None],
    clip: Callable[[], float],
    dc_lambda: float = 0.0,
    staleness_bound: int = 0,
    dc_mode: str = "constant",
    dc_decay: float = 0.95,
    start: ServerState | None = None,
    after_update: Callable[[ParameterServer], bool] | None = None,
) -> ServerReport:
    """Run the parameter server on group rank 0 until `total_updates` have been applied
    (counted from the first update ever: `start.version` are done), or `after_update` says
    stop.

    clip: called with the pushed gradient in `.grad`; clips it, returns its norm before.
    control: the host-side (gloo) group of the same ranks as `group`, for the headers.
    dc_lambda, dc_mode, dc_decay: DC-ASGD's lambda (lambda0 when adaptive), constant or
    adaptive, and the adaptive mean square's decay m.
    start: where a resumed server stands (default: a fresh start).
    after_update: called after every applied update, once the pushing worker's next batch
        is assigned (so `server.state` is whole: a checkpoint may be taken here); True
        stops the run: every later push is answered with STOP, not applied.
    """
    _check_same_ranks(group, control)
    workers = [r for r in range(group.size) if r != group.rank]
    state = start if start is not None else ServerState.fresh(workers)
    compensate = DelayCompensation(dc_lambda, dc_mode, dc_decay)
    server = ParameterServer(model, optimizer, (group, control), set_lr, clip, compensate, state)
    numel = sum(p.numel() for p in model.parameters())
    device = next(model.parameters()).device
    done = state.version >= total_updates
    for w in workers:  # every worker starts on its own batch (a resumed one: its assigned)
        server.reply(w, STOP if done else float(state.assigned[w]))
    active = set() if done else set(workers)
    inbox = _Inbox(control, sorted(active))
    while active:
        w, pushed = inbox.next()  # whichever worker pushes first is served first
        grad = comm.recv(torch.empty(numel, device=device), group, w)
        server.stop_asked = server.stop_asked or pushed[4] != 0.0
        if not done:  # else a push in flight when the run ended: not applied, not counted
            done = _take_push(server, w, grad, pushed, staleness_bound, after_update)
            done = done or state.version >= total_updates
        if done:
            server.reply(w, STOP)
            active.discard(w)
            continue
        server.reply(w, float(state.assigned[w]))
        inbox.expect(w)
    return server.report


def _take_push(
    server: ParameterServer,
    worker: int,
    grad: torch.Tensor,
    pushed: list[float],
    staleness_bound: int,
    after_update: Callable[[ParameterServer], bool] | None,
) -> bool:
    """Apply one pushed gradient, or drop it when it is staler than the bound; hand the
    worker its next batch. True when `after_update` asks to stop."""
    state = server.state
    staleness = state.version - int(pushed[0])
    if staleness_bound and staleness > staleness_bound:
        server.report.dropped += 1
        state.hand_out(worker)  # the dropped batch is not redone
        return False
    server.apply(worker, grad, pushed, staleness)
    state.hand_out(worker)
    return after_update(server) if after_update is not None else False


def work(
    model: nn.Module,
    group: comm.CommGroup,
    control: comm.CommGroup,
    compute: Callable[[int], tuple[float, float]],
    server: int = 0,
    stop: Callable[[], bool] | None = None,
) -> int:
    """Run a worker: pull, `compute(batch)` (fills .grad, returns (loss, tokens)), push.

    stop: asked before each push, on this rank alone (a SIGTERM flag); True tells the
        server, which decides when the run stops. The worker runs until it gets STOP.
    Returns the number of gradients this worker pushed.
    """
    _check_same_ranks(group, control)
    numel = sum(p.numel() for p in model.parameters())
    header = torch.empty(2, dtype=torch.float64, device="cpu")  # host-side, over control
    params = torch.empty(numel, device=next(model.parameters()).device)
    pushes = 0
    while True:
        version, batch = comm.recv(header, control, server).tolist()
        if batch == STOP:
            return pushes
        _load_flat(model, comm.recv(params, group, server))
        model.zero_grad(set_to_none=False)
        loss, tokens = compute(int(batch))
        grad = torch.cat(
            [
                (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                for p in model.parameters()
            ]
        )
        pushed = [version, batch, loss, tokens, float(stop is not None and stop())]
        comm.send(torch.tensor(pushed, dtype=torch.float64, device="cpu"), control, server)
        comm.send(grad, group, server)
        pushes += 1
