"""The sharded update shared by ZeRO-1/2/3: AdamW on this rank's flat shards only.

Each rank runs torch.optim.AdamW on its fp32 shard(s) (the master copy in mixed
precision, else the parameters themselves), so Adam's m and v exist for 1/k of the model:
ZeRO's P_os (arXiv:1910.02054, section 5.1). Weight decay is decoupled (AdamW,
arXiv:1711.05101) and applies to matrices and embeddings only (train/optim.py); a shard
mixes both kinds, so the decay is applied here to the decayed pieces, p <- p (1 - lr wd),
and the inner AdamW runs with weight_decay 0. torch's AdamW applies the same
multiplication first, before the moment update, so the arithmetic is the same.

Also here: the gradient operations a training loop needs on sharded gradients (scale,
the global norm and clipping: one all-reduce of a sum of squares), and the memory report that
counts every storage the model, the wrapper and the optimizer hold.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import nn

from paratrain import comm
from paratrain.parallel.mixed_precision import DynamicLossScaler, found_inf
from paratrain.parallel.zero_flat import FlatShard


class ShardedAdamW:
    """AdamW over flat shards; `step()` updates them and then calls `after_step`.

    Drives like a torch optimizer: set `param_groups[i]["lr"]`, call `step()`.
    after_step: the wrapper's follow-up, e.g. ZeRO-1/2's all-gather of updated parameters.
    scaler: fp16's loss scaler; a step whose gradients overflowed on any rank is skipped.
    """

    def __init__(
        self,
        shards: list[FlatShard],
        group: comm.CommGroup | None,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        eps: float = 1e-8,
        after_step: Callable[[], None] | None = None,
        scaler: DynamicLossScaler | None = None,
    ) -> None:
        self.shards = shards
        self.group = group
        self.weight_decay = weight_decay
        self.after_step = after_step
        self.scaler = scaler
        params = [s.optimized for s in shards if s.optimized.numel()]
        self.inner = torch.optim.AdamW(
            params, lr=lr, betas=betas, eps=eps, weight_decay=0.0, foreach=True
        )
        self._decayed = [v for s in shards for v in s.decay_views(s.optimized)]
        self.steps_skipped = 0

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients belong to the wrapper (`wrapper.zero_grad()`); nothing to do here."""

    @torch.no_grad()
    def step(self) -> None:
        if self.scaler is not None and self.group is not None:
            overflow = found_inf([s.grad for s in self.shards], self.group)
            self.scaler.update(overflow)
            if overflow:  # nothing changed anywhere: no gather is needed either
                self.steps_skipped += 1
                return
        for s in self.shards:
            opt = s.optimized
            s.optimized.grad = s.grad if s.grad.dtype == opt.dtype else s.grad.to(opt.dtype)
        lr = self.inner.param_groups[0]["lr"]
        if self.weight_decay and self._decayed:
            torch._foreach_mul_(self._decayed, 1.0 - lr * self.weight_decay)
        self.inner.step()
        for s in self.shards:
            s.optimized.grad = None
            if s.master is not None:
                s.param.copy_(s.master)  # the 16-bit compute copy follows the master
        if self.after_step is not None:
            self.after_step()

    def state_dict(self) -> dict:
        return self.inner.state_dict()


def scale_grads_(shards: list[FlatShard], factor: float) -> None:
    grads = [s.grad for s in shards if s.grad.numel()]
    if grads and factor != 1.0:
        torch._foreach_mul_(grads, factor)


def clip_grad_norm_(
    shards: list[FlatShard], group: comm.CommGroup | None, max_norm: float
) -> float:
    """Global L2 norm of the gradient (before clipping), clipping to max_norm if positive.

    Shards are disjoint, so the squared norm is the sum over ranks of each rank's squared
    shard norm: one all-reduce of 8 bytes. group None: the shards hold the whole gradient.
    Norms are taken per parameter piece, like torch.nn.utils.clip_grad_norm_'s per-tensor
    norms (one fp32 norm over a whole flat buffer rounds measurably worse), and combined in
    float64. Same clip coefficient as torch: max_norm / (norm + 1e-6).
    """
    grads = [s.grad for s in shards if s.grad.numel()]
    pieces = [v for s in shards for v in s.piece_views(s.grad)]
    squares = torch.zeros(1, dtype=torch.float64)
    if pieces:
        norms = torch.stack(torch._foreach_norm(pieces)).double()
        squares += norms.pow(2).sum()
    if group is not None:
        comm.all_reduce(squares, group, op="sum")
    norm = float(squares.sqrt())
    if max_norm > 0:
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0 and grads:
            torch._foreach_mul_(grads, coef)
    return norm


@dataclass(frozen=True)
class MemoryReport:
    """Bytes of unique storage on one rank at the step boundary, by kind.

    padding: elements added so shards are equal, beyond what the planner's formula
    (plan/memory.py, one buffer padded to a multiple of k) already counts.
    other: storage reachable from the model or optimizer that is none of the above, e.g.
    AdamW's per-tensor step counters.
    """

    params: int
    grads: int
    master: int
    optimizer: int
    padding: int
    other: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.master + self.optimizer + self.padding + self.other

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def memory_report(
    known: list[tuple[str, torch.Tensor]],
    padding: dict[str, int],
    module: nn.Module,
    optimizer: ShardedAdamW | None,
) -> MemoryReport:
    """Count each storage once: the wrapper's `known` buffers by category, the optimizer's
    moments, and anything else reachable from the module's parameters, gradients and
    buffers as `other`. `padding` (bytes per category) is moved out into its own line."""
    seen: set[int] = set()
    totals = dict.fromkeys(("params", "grads", "master", "optimizer", "other"), 0)

    def add(kind: str, t: torch.Tensor | None) -> None:
        if t is None:
            return
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            return
        seen.add(storage.data_ptr())
        totals[kind] += storage.nbytes()

    for kind, t in known:
        add(kind, t)
    if optimizer is not None:
        for state in optimizer.inner.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    add("optimizer" if key in ("exp_avg", "exp_avg_sq") else "other", value)
    for p in module.parameters():
        add("other", p.data)
        add("other", p.grad)
    for b in module.buffers():
        add("other", b)
    for kind, nbytes in padding.items():
        totals[kind] -= nbytes
    return MemoryReport(padding=sum(padding.values()), **totals)
