"""DiLoCo's outer step (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication
Training of Language Models", arXiv:2311.08105, algorithm 1).

Replica groups train apart, each with its own inner optimizer on its own share of every
batch; every H inner steps they take one outer step together. Each group's pseudo-gradient
is the global parameters minus its own, theta_global - theta_group (the direction the
outer step descends: with outer lr 1 and no momentum the step lands on the groups'
average); their mean over the groups moves the global parameters by SGD with momentum
mu (Nesterov by default):

    v <- mu v + delta;    theta_global <- theta_global - lr (delta + mu v)   (Nesterov)
                          theta_global <- theta_global - lr v                (plain)

and every group continues from theta_global, its inner optimizer's state its own.

A rank keeps a global copy and the outer momentum of the pieces of the parameters it
updates (`Replica.checkpoint_pieces`' "model" tensors: ZeRO's fp32 master shards, a whole
module's parameters). The ranks at one place of every group (dp_replicate) hold the same
pieces, so the outer step is one all-reduce of this rank's pseudo-gradient pieces per
dtype over that group, once per H steps, then the wrapper's `after_load` makes every copy
(ZeRO-1/2's gathered parameters, the compute dtype's) agree with the new values.

A checkpoint is taken only at an outer step, when the global parameters are the local
ones: it stores the outer momentum beside the model, and each group's inner optimizer
state under the group's own keys (checkpoint/training_state.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from paratrain import comm
from paratrain.comm.codecs import CODECS
from paratrain.comm.group import CommGroup
from paratrain.comm.low_precision import encoded_mean

# one dtype's pseudo-gradients, their concatenation, and the all-reduce in flight (or None)
Call = tuple[list[torch.Tensor], torch.Tensor, Any]


class Started:
    """An outer step in flight: its pieces' pseudo-gradients by index, and per dtype those
    tensors, their concatenation and the all-reduce carrying it (None: run at finish)."""

    def __init__(self, deltas: dict[int, torch.Tensor], calls: list[Call]) -> None:
        self.deltas, self.calls = deltas, calls


@dataclass(frozen=True)
class OuterSettings:
    lr: float
    momentum: float  # 0: none
    nesterov: bool
    dtype: str = "float32"  # the pseudo-gradient's on the wire: float32, or comm/codecs.py's


class OuterStep:
    """The outer optimizer over this rank's `pieces` (live views of what it updates)."""

    def __init__(
        self,
        pieces: list[torch.Tensor],
        across: CommGroup,
        settings: OuterSettings,
        after: Callable[[], None],
        names: list[str] | None = None,
    ) -> None:
        """`after`: the wrappers' rebuild of their copies; `names`: the pieces' parameters,
        for a caller that groups them (Streaming DiLoCo's fragments)."""
        self.local, self.across, self.settings, self.after = pieces, across, settings, after
        self.names = names or []
        self.global_ = [p.detach().clone() for p in pieces]
        self.velocity = [torch.zeros_like(p) for p in pieces] if settings.momentum else []

    def memory(self) -> dict[str, int]:
        """Bytes this rank keeps for the outer step, by the planner's kinds: the global
        parameters ("master", a float32 copy) and the outer momentum ("optimizer")."""
        held = {"master": self.global_, "optimizer": self.velocity}
        return {k: sum(t.numel() * t.element_size() for t in ts) for k, ts in held.items()}

    @torch.no_grad()
    def take_local(self) -> None:
        """The global parameters are the local ones: after a checkpoint, saved at an outer
        step (when they were), is loaded into them."""
        for g, p in zip(self.global_, self.local, strict=True):
            g.copy_(p)

    @torch.no_grad()
    def start(self, which: list[int] | None = None) -> Started:
        """Take the pseudo-gradients of `which` pieces (Streaming DiLoCo's fragments;
        default all) and start their mean over the groups; `finish` applies it. Every rank
        of `across` must name the same pieces. In float32 the all-reduce runs while the
        caller goes on (an overlapped outer step); a codec's mean runs at `finish`."""
        chosen = range(len(self.local)) if which is None else which
        deltas = {i: self.global_[i] - self.local[i] for i in chosen}
        calls = []
        for dtype in sorted({d.dtype for d in deltas.values()}, key=str):
            mine = [d for d in deltas.values() if d.dtype == dtype]
            flat = torch.cat([d.reshape(-1) for d in mine])
            plain = self.settings.dtype == "float32"
            calls.append(
                (mine, flat, comm.all_reduce(flat, self.across, async_op=True) if plain else None)
            )
        return Started(deltas, calls)

    @torch.no_grad()
    def finish(self, started: Started, merge: float = 0.0, rebuild: bool = True) -> None:
        """Step the global parameters of `started` by their groups' mean pseudo-gradient,
        then set each local one to merge x local + (1 - merge) x global (0: the global,
        exactly); the wrappers then rebuild their copies (collective), unless the caller
        does it once for several (`rebuild` False, then `after()`)."""
        for mine, flat, pending in started.calls:
            if pending is not None:
                mean = pending.wait().div_(self.across.size)
            else:
                codec = CODECS[self.settings.dtype]
                mean = encoded_mean(flat.float(), self.across, codec).to(flat.dtype)
            for d, part in zip(mine, mean.split([d.numel() for d in mine]), strict=True):
                d.copy_(part.view_as(d))
        s = self.settings
        for i, delta in started.deltas.items():
            update = delta
            if s.momentum:
                v = self.velocity[i].mul_(s.momentum).add_(delta)
                update = delta.add(v, alpha=s.momentum) if s.nesterov else v
            self.global_[i].sub_(update, alpha=s.lr)
            if merge:
                self.local[i].mul_(merge).add_(self.global_[i], alpha=1 - merge)
            else:
                self.local[i].copy_(self.global_[i])
        if rebuild:
            self.after()

    def step(
        self, which: list[int] | None = None, merge: float = 0.0, rebuild: bool = True
    ) -> None:
        """`start` then `finish` at once."""
        self.finish(self.start(which), merge, rebuild)

    @torch.no_grad()
    def take_global(self) -> None:
        """Every local piece set to its global one (the run's end: one model again); the
        caller then rebuilds the wrappers' copies (`after()`)."""
        for g, p in zip(self.global_, self.local, strict=True):
            p.copy_(g)
