"""Asynchronous data parallelism: a parameter server and workers that never wait for each other.

Rank 0 of the group holds the master parameters and the optimizer. Each worker pulls the
parameters, computes a gradient on its own batch and pushes it; the server applies every
gradient as it arrives and answers that worker alone with fresh parameters and its next
batch. A gradient computed on parameters that are `s` updates old has staleness `s`
(seeds, 9.2: Hogwild!/parameter-server asynchronous SGD, Dean et al. 2012).

Delay compensation (DC-ASGD, Zheng et al. 2017, arXiv:1609.08326) corrects a stale gradient
with a first-order Taylor term, approximating the Hessian by lambda * g * g:
    g_corrected = g + lambda * g * g * (w_now - w_pulled)
DC-ASGD-c keeps lambda constant; DC-ASGD-a divides it, per coordinate, by the root of a
moving average of g * g, so that one lambda0 suits coordinates whose gradients differ in
scale by orders of magnitude (the authors' implementation: microsoft/Delayed-Compensation-
Asynchronous-Stochastic-Gradient-Descent-for-Multiverso, dcasgda_updater.h).
A staleness bound drops gradients older than the bound (the worker then gets fresh
parameters and recomputes), trading wasted work for freshness.

Messages (all through paratrain.comm point-to-point):
    worker -> server: header float64 [pulled_version, batch_index, loss, tokens], grad
    server -> worker: header float64 [version, next_batch_index or -1 to stop], params
Headers are host-side and go over `control`, a gloo group of the same ranks: the server
receives them from whichever worker pushes first, which NCCL cannot do. Parameters and
gradients then go over `group` (NCCL on GPUs), between the two ranks the header named.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from paratrain import comm
from paratrain.config import DC_MODES

STOP = -1.0
DC_MEAN_SQUARE_EPS = 1e-7  # inside the root, as in the authors' updater (module docstring)


def dc_asgd_correct(
    grad: torch.Tensor, w_now: torch.Tensor, w_pulled: torch.Tensor, lam: float | torch.Tensor
) -> torch.Tensor:
    """g + lambda * g * g * (w_now - w_pulled); lambda = 0 leaves g unchanged.

    lam: a number (DC-ASGD-c) or one value per coordinate (DC-ASGD-a's lambda_t).
    """
    if not isinstance(lam, torch.Tensor) and lam == 0.0:
        return grad
    return grad + lam * grad * grad * (w_now - w_pulled)


def dc_mean_square(mean_square: torch.Tensor, grad: torch.Tensor, decay: float) -> torch.Tensor:
    """MeanSquare(t) = m * MeanSquare(t-1) + (1 - m) * g * g (arXiv:1609.08326, DC-ASGD-a)."""
    return decay * mean_square + (1.0 - decay) * grad * grad


def dc_adaptive_lambda(mean_square: torch.Tensor, lam0: float) -> torch.Tensor:
    """lambda_t = lambda0 / sqrt(MeanSquare(t)) per coordinate (arXiv:1609.08326, DC-ASGD-a).

    No bias correction of the zero start, as in the paper and the authors' updater: the
    first ~1 / (1 - m) updates get a larger lambda_t.
    """
    return lam0 / torch.sqrt(mean_square + DC_MEAN_SQUARE_EPS)


@dataclass
class DelayCompensation:
    """DC-ASGD as the server applies it: constant lambda, or DC-ASGD-a's lambda_t with the
    mean square of every applied gradient (one average for the server, as MeanSquare(t) is
    indexed by the server's update t; the authors' updater keeps one per worker). Adaptive
    costs the server one more flat copy of the parameters."""

    lam: float = 0.0
    mode: str = "constant"  # or "adaptive" (config.DC_MODES)
    decay: float = 0.95  # m of the mean square, adaptive only
    mean_square: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.mode not in DC_MODES:
            raise ValueError(f"DC-ASGD mode {self.mode!r}; valid: {', '.join(DC_MODES)}")

    def __call__(
        self, grad: torch.Tensor, w_now: torch.Tensor, w_pulled: torch.Tensor
    ) -> torch.Tensor:
        if self.lam == 0.0:
            return grad
        if self.mode == "constant":
            return dc_asgd_correct(grad, w_now, w_pulled, self.lam)
        if self.mean_square is None:
            self.mean_square = torch.zeros_like(grad)
        # This gradient enters the average before its own lambda_t, as in the updater.
        self.mean_square = dc_mean_square(self.mean_square, grad, self.decay)
        lam_t = dc_adaptive_lambda(self.mean_square, self.lam)
        return dc_asgd_correct(grad, w_now, w_pulled, lam_t)


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


class _Server:
    """What the server keeps between messages: the version, what each worker last pulled,
    and the report of every update."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        groups: tuple[comm.CommGroup, comm.CommGroup],
        set_lr: Callable[[int], None],
        clip: Callable[[], float],
        compensate: DelayCompensation,
    ) -> None:
        self.model, self.optimizer = model, optimizer
        self.group, self.control = groups
        self.set_lr, self.clip, self.compensate = set_lr, clip, compensate
        self.version = 0
        self.pulled: dict[int, torch.Tensor] = {}  # worker -> the parameters it was sent
        self.report = ServerReport(compensation=compensate.mode if compensate.lam else "none")
        self.start = time.perf_counter()

    def reply(self, worker: int, batch: float) -> None:
        """Send the version and the next batch index; unless STOP, the parameters too."""
        header = torch.tensor([float(self.version), batch], dtype=torch.float64, device="cpu")
        comm.send(header, self.control, worker)
        if batch != STOP:
            self.pulled[worker] = _flat_params(self.model)
            comm.send(self.pulled[worker], self.group, worker)

    def apply(self, worker: int, grad: torch.Tensor, header: list[float], staleness: int) -> None:
        """Correct the pushed gradient for its delay, clip it and take one optimizer step."""
        _, batch, loss, tokens = header
        index = len(self.report.updates)
        self.set_lr(index)
        grad = self.compensate(grad, _flat_params(self.model), self.pulled[worker])
        _set_grads(self.model, grad)
        norm = self.clip()
        self.optimizer.step()
        self.version += 1
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
) -> ServerReport:
    """Run the parameter server on group rank 0 until `total_updates` have been applied.

    clip: called with the pushed gradient in `.grad`; clips it, returns its norm before.
    control: the host-side (gloo) group of the same ranks as `group`, for the headers.
    dc_lambda, dc_mode, dc_decay: DC-ASGD's lambda (lambda0 when adaptive), constant or
    adaptive, and the adaptive mean square's decay m.
    """
    _check_same_ranks(group, control)
    compensate = DelayCompensation(dc_lambda, dc_mode, dc_decay)
    server = _Server(model, optimizer, (group, control), set_lr, clip, compensate)
    workers = [r for r in range(group.size) if r != group.rank]
    numel = sum(p.numel() for p in model.parameters())
    device = next(model.parameters()).device
    for next_batch, w in enumerate(workers):  # every worker starts on its own batch
        server.reply(w, float(next_batch))
    next_batch = len(workers)
    active = set(workers)
    header = torch.empty(4, dtype=torch.float64, device="cpu")  # host-side, over control
    while active:
        w = comm.recv_any(header, control)  # whichever worker pushes first is served first
        grad = comm.recv(torch.empty(numel, device=device), group, w)
        staleness = server.version - int(header[0])
        if len(server.report.updates) >= total_updates:
            pass  # a push in flight when the run ended: not applied, not counted
        elif staleness_bound and staleness > staleness_bound:
            server.report.dropped += 1
        else:
            server.apply(w, grad, header.tolist(), staleness)
        if len(server.report.updates) >= total_updates:
            server.reply(w, STOP)
            active.discard(w)
            continue
        server.reply(w, float(next_batch))
        next_batch += 1
    return server.report


def work(
    model: nn.Module,
    group: comm.CommGroup,
    control: comm.CommGroup,
    compute: Callable[[int], tuple[float, float]],
    server: int = 0,
) -> int:
    """Run a worker: pull, `compute(batch)` (fills .grad, returns (loss, tokens)), push.

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
        pushed = [version, batch, loss, tokens]
        comm.send(torch.tensor(pushed, dtype=torch.float64, device="cpu"), control, server)
        comm.send(grad, group, server)
        pushes += 1
