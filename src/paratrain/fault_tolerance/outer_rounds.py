"""DiLoCo under fault tolerance (--dp-mode diloco --fault-tolerance, docs/diloco.md).

Every step is still a round (the coordinator names its participants and heals a group that
is behind), but DiLoCo's groups share nothing on an inner step: each steps on its own
gradient, and the round only votes. A round that ends an H-step block (and the last step)
is an outer round: after its inner update, its participants average their pseudo-gradients
(global minus local) over the round's cross-group group, vote, and only a committed round
moves the global parameters and the outer momentum and sets every local piece to the
global one. Since the inner update comes before the vote there, the round first keeps a
copy of the group's state: an aborted outer round puts it back, so that, as every round,
it changes nothing. A group killed in the middle of an inner loop is left out of the
rounds that follow; the next outer round averages the others' pseudo-gradients only; the
relaunched group heals from a live peer, whose state (across_groups.state_tensors) holds
the global parameters and the outer momentum too, so every group's global state is then
bitwise the same.

Plain DiLoCo only: one fragment, no --sync-delay or --merge-alpha, float32 outer
gradients (a codec's mean would move bytes after the vote).
"""

from __future__ import annotations

from typing import Any

import torch

from paratrain.comm.group import CommGroup
from paratrain.parallel.diloco import OuterStep, Started
from paratrain.train.diloco import checkpoint_after
from paratrain.train.engine import Engine


class OuterRound:
    """The outer step of the rounds that end a block, done as the module docstring says."""

    def __init__(self, outer: OuterStep, every: int, steps: int) -> None:
        self.outer, self.every, self.steps = outer, every, steps
        self._kept: list[torch.Tensor] = []

    def due(self, done: int) -> bool:
        """Whether the round of the step that makes `done` steps is an outer round."""
        return done % self.every == 0 or done == self.steps

    def checkpoint_due(self, done: int, every: int) -> bool:
        """--checkpoint-every `every`, at outer steps only (train/diloco.py)."""
        return checkpoint_after(done, self.due(done), every, self.every, self.steps)

    def keep(self, tensors: list[torch.Tensor]) -> None:
        """A copy of the group's state (across_groups.state_tensors) before the update."""
        self._kept = [t.detach().clone() for t in tensors]

    @torch.no_grad()
    def put_back(self, tensors: list[torch.Tensor], engine: Engine) -> None:
        """The round aborted: the state as it was before its inner update."""
        for t, kept in zip(tensors, self._kept, strict=True):
            t.copy_(kept)
        for r in engine.replicas:
            r.after_load()
        self._kept = []

    def mean(self, across: CommGroup) -> Started:
        """The participants' mean pseudo-gradient, computed (raises if a peer fails)."""
        self.outer.across = across
        started = self.outer.start()
        for _, _, pending in started.calls:
            pending.wait()
        return started

    def land(self, started: Started) -> None:
        """The round committed: the outer update, every local piece the global one."""
        self.outer.finish(started)
        self._kept = []


def outer_round(cfg: Any, optimizer: Any) -> OuterRound | None:
    """The run's outer rounds under --dp-mode diloco, else None."""
    outer = getattr(optimizer, "outer", None)
    if outer is None:
        return None
    return OuterRound(outer, cfg.parallel.sync_every, cfg.train.steps)
