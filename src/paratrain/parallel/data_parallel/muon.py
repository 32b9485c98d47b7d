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
from paratrain.parallel.data_parallel import muon_exchange, muon_math
from paratrain.parallel.data_parallel.muon_math import MuonSettings
from paratrain.parallel.data_parallel.replica import MOMENTS, MUON_MOMENTUM
from paratrain.parallel.tensor_parallel.state import sharded_parameters
from paratrain.plan.muon import owners_of


def muon_matrix_names(module: nn.Module, patterns: Sequence[str]) -> list[str]:
    """The parameters Muon takes: the `weight` of each module a pattern names, in
    `named_parameters` order, each once (a tied weight under its first name only)."""
    wanted = {f"{name}.weight" for pattern in patterns for name in matching(module, pattern)}
    return [n for n, p in module.named_parameters() if n in wanted and p.requires_grad]


class WholeMuon:
    """Muon over `names` of `module` (whole on every rank of `group`, or split over `tp`
    along the dimension `sharded_parameters` gives) and `adamw` over the rest; driven like
    a torch optimizer: `param_groups[i]["lr"]`, `step()`."""

    def __init__(
        self,
        module: nn.Module,
        names: Sequence[str],
        adamw: torch.optim.Optimizer,
        group: comm.CommGroup | None,
        lr: float,
        weight_decay: float,
        settings: MuonSettings,
        tp: comm.CommGroup | None = None,
    ) -> None:
        named = dict(module.named_parameters())
        self.names = list(names)
        self.matrices = [named[n] for n in self.names]
        self.adamw, self.group, self.settings = adamw, group, settings
        self.tp = tp if tp is not None and tp.size > 1 else None
        split = sharded_parameters(module) if self.tp is not None else {}
        for n in self.names if self.tp is not None else ():
            if n not in split:  # every plan's Muon matrix is column- or row-parallel
                raise ValueError(f"Muon matrix {n} is not split over tp: not supported")
        self.dims = [split[n][1] if n in split else 0 for n in self.names]
        t = self.tp.size if self.tp is not None else 1
        local = [tuple(p.shape) for p in self.matrices]
        self.shapes = muon_exchange.whole_shapes(local, self.dims, t)  # tp shards together
        dp = group.size if group is not None else 1
        self.owners = owners_of([(r, c) for r, c in self.shapes], dp * t)
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
        s = self.settings
        for i in stepped:
            p = self.matrices[i]
            assert p.grad is not None
            self.momentum[p].lerp_(p.grad, 1 - s.momentum)
        results = self._split_results(stepped) if self.tp else self._whole(stepped)
        lr, decay = self.muon_group["lr"], self.muon_group["weight_decay"]
        for i in stepped:
            p = self.matrices[i]
            step_lr = muon_math.adjusted_lr(lr, self.shapes[i], s.lr_adjust)
            p.mul_(1 - lr * decay)
            p.add_(results[i], alpha=-step_lr)

    def _update(self, i: int) -> torch.Tensor:
        """What Muon orthogonalizes for matrix i: the momentum, or with Nesterov the
        gradient moved towards it (torch.optim.Muon's `grad.lerp(buf, momentum)`)."""
        p, s = self.matrices[i], self.settings
        buf = self.momentum[p]
        return p.grad.lerp(buf, s.momentum) if s.nesterov and p.grad is not None else buf

    def _whole(self, stepped: list[int]) -> dict[int, torch.Tensor]:
        """Whole matrices: each owner orthogonalizes its own, then one all-gather; the
        results in torch.optim.Muon's layout (a tall matrix's as a transposed view)."""
        s, rank = self.settings, self.group.rank if self.group is not None else 0
        wide = {
            i: muon_math.orthogonalize_wide(self._update(i), s.ns_steps, s.ns_dtype)
            for i in stepped
            if self.owners[i] == rank
        }
        results = self._exchange(stepped, wide)
        return {i: muon_math.as_update(results[i], self.shapes[i]) for i in stepped}

    def _split_results(self, stepped: list[int]) -> dict[int, torch.Tensor]:
        """Matrices split over tp: this rank's shard of every result (muon_exchange.py)."""
        assert self.tp is not None
        s, t = self.settings, self.tp.size
        d = self.group.rank if self.group is not None else 0
        ours = {
            i: self._update(i) for i in stepped if muon_exchange.owner_of(self.owners[i], t)[0] == d
        }
        shapes = {i: self.matrices[i].shape for i in ours}
        # The updates go once sent (Nesterov's are copies), each gathered matrix once
        # orthogonalized, the results once packed: gpt-tiny over tp 2 and dp 2 peaked
        # 5.5 MB above the held state with every stage's buffers kept to the step's end.
        whole = muon_exchange.gather_to_owners(ours, self.owners, self.dims, d, self.tp)
        results = {i: muon_math.newton_schulz(whole.pop(i), s.ns_steps, s.ns_dtype)
                   for i in sorted(whole)}  # fmt: skip
        mine = muon_exchange.scatter_from_owners(
            results, shapes, self.owners, self.dims, d, self.tp, s.ns_dtype
        )
        if self.group is not None and self.group.size > 1:
            numels = [p.numel() for p in self.matrices]
            mine = muon_exchange.gather_over_replicas(
                mine, numels, self.owners, stepped, t, self.group, s.ns_dtype
            )
        return {i: mine[i].view(self.matrices[i].shape) for i in stepped}

    def _exchange(
        self, stepped: list[int], wide: dict[int, torch.Tensor]
    ) -> dict[int, torch.Tensor]:
        """Every stepped matrix's wide result on every rank: one all-gather of the owners'
        results as raw bytes (exact, and every backend carries bytes; gloo has no bfloat16
        or int16 all-gather), owner by owner. A replica with no matrix (the experts' share
        of a mixture of experts, over expert_dp) has nothing to send: every rank of its
        group holds the same parameters, so all of them skip the call."""
        if self.group is None or self.group.size == 1 or not self.matrices:
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
