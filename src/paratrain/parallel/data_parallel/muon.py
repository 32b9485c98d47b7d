"""Muon for a module held whole on every rank of its data-parallel group, AdamW for the
rest of its parameters: `--optimizer muon` under plain data parallelism.

Which parameters are Muon's comes from the model plan (`MuonSettings.matrices`: module-name
patterns whose `weight` is a hidden matrix), never from a tensor's `ndim`, so embeddings,
the head, norms, biases and routers stay with AdamW whatever their shape.

One step, after the gradients are averaged over the group (every rank holds the same):
1. AdamW steps the other parameters, as `adamw()` would alone;
2. every rank moves every matrix's momentum, M <- mu M + (1 - mu) G (elementwise and cheap,
   so each rank keeps all of them and a checkpoint finds them anywhere);
3. each matrix is orthogonalized once, by one owner (plan/muon.py `owners_of`: the work
   spread by its cost); the owners' bfloat16 results travel in one all-gather;
4. every rank applies W <- W (1 - lr wd) - lr_adj O to every matrix.
Each step runs the arithmetic of torch.optim.Muon on the same values in the same layouts, so
the parameters are bitwise those of torch.optim.Muon plus AdamW fed the same gradients
(tests/test_muon.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from paratrain import comm
from paratrain.module_names import matching
from paratrain.parallel.data_parallel import muon_math
from paratrain.parallel.data_parallel.muon_math import MuonSettings
from paratrain.parallel.data_parallel.replica import MOMENTS, MUON_MOMENTUM
from paratrain.plan.muon import owners_of


def muon_matrix_names(module: nn.Module, patterns: Sequence[str]) -> list[str]:
    """The parameters Muon takes: the `weight` of each module a pattern names, in
    `named_parameters` order, each once (a tied weight under its first name only)."""
    wanted = {f"{name}.weight" for pattern in patterns for name in matching(module, pattern)}
    return [n for n, p in module.named_parameters() if n in wanted and p.requires_grad]


class WholeMuon:
    """Muon over `names` of `module` (whole on every rank of `group`) and `adamw` over the
    rest; driven like a torch optimizer: `param_groups[i]["lr"]`, `step()`."""

    def __init__(
        self,
        module: nn.Module,
        names: Sequence[str],
        adamw: torch.optim.Optimizer,
        group: comm.CommGroup | None,
        lr: float,
        weight_decay: float,
        settings: MuonSettings,
    ) -> None:
        named = dict(module.named_parameters())
        self.names = list(names)
        self.matrices = [named[n] for n in self.names]
        self.adamw, self.group, self.settings = adamw, group, settings
        ranks = group.size if group is not None else 1
        self.owners = owners_of([(p.shape[0], p.shape[1]) for p in self.matrices], ranks)
        self.momentum: dict[torch.Tensor, torch.Tensor] = {
            p: torch.zeros_like(p) for p in self.matrices
        }
        self.muon_group: dict[str, Any] = {
            "params": self.matrices, "lr": lr, "weight_decay": weight_decay,
        }  # fmt: skip

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [*self.adamw.param_groups, self.muon_group]

    @property
    def state(self) -> dict[torch.Tensor, dict[str, Any]]:
        """Per parameter, its optimizer state (AdamW's, or Muon's momentum)."""
        state: dict[torch.Tensor, dict[str, Any]] = dict(self.adamw.state)
        state.update({p: {MUON_MOMENTUM: m} for p, m in self.momentum.items()})
        return state

    def moment_keys(self, name: str) -> tuple[str, ...]:
        """The state a checkpoint stores for parameter `name` beside its value."""
        return (MUON_MOMENTUM,) if name in self.names else MOMENTS

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients belong to the wrapper (`wrapper.zero_grad()`); nothing to do here."""

    @torch.no_grad()
    def step(self) -> None:
        self.adamw.step()
        stepped = [i for i, p in enumerate(self.matrices) if p.grad is not None]
        s, rank = self.settings, self.group.rank if self.group is not None else 0
        wide: dict[int, torch.Tensor] = {}
        for i in stepped:
            p = self.matrices[i]
            assert p.grad is not None
            buf = self.momentum[p]
            buf.lerp_(p.grad, 1 - s.momentum)
            if self.owners[i] == rank:
                update = p.grad.lerp(buf, s.momentum) if s.nesterov else buf
                wide[i] = muon_math.orthogonalize_wide(update, s.ns_steps, s.ns_dtype)
        results = self._exchange(stepped, wide)
        lr, decay = self.muon_group["lr"], self.muon_group["weight_decay"]
        for i in stepped:
            p = self.matrices[i]
            step_lr = muon_math.adjusted_lr(lr, p.shape, s.lr_adjust)
            p.mul_(1 - lr * decay)
            p.add_(muon_math.as_update(results[i], p.shape), alpha=-step_lr)

    def _exchange(
        self, stepped: list[int], wide: dict[int, torch.Tensor]
    ) -> dict[int, torch.Tensor]:
        """Every stepped matrix's wide result on every rank: one all-gather of the owners'
        results as raw bytes (exact, and every backend carries bytes; gloo has no bfloat16
        or int16 all-gather), owner by owner."""
        if self.group is None or self.group.size == 1:
            return wide
        by_owner: list[list[int]] = [[] for _ in range(self.group.size)]
        for i in stepped:
            by_owner[self.owners[i]].append(i)
        dtype = self.settings.ns_dtype
        width = dtype.itemsize
        sizes = [width * sum(self.matrices[i].numel() for i in mine) for mine in by_owner]
        device = self.matrices[0].device
        own = by_owner[self.group.rank]
        if own:
            flat = torch.cat([wide[i].reshape(-1) for i in own]).to(device=device, dtype=dtype)
        else:  # more ranks than matrices: this one only receives
            flat = torch.empty(0, device=device, dtype=dtype)
        gathered = comm.all_gather_flat(flat.view(torch.uint8), self.group, sizes=sizes)
        out, offset = {}, 0
        for mine in by_owner:
            for i in mine:
                rows, cols = sorted(self.matrices[i].shape)  # the wide orientation
                n = width * rows * cols
                out[i] = gathered[offset : offset + n].view(dtype).view(rows, cols)
                offset += n
        return out
