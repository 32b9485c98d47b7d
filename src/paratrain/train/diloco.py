"""DiLoCo's outer steps in the training loop (--dp-mode diloco; parallel/diloco.py): when
they are taken, and when a checkpoint may be (only when the groups hold one model)."""

from __future__ import annotations

from typing import Any

from paratrain.config import RunConfig
from paratrain.mesh import Mesh
from paratrain.parallel.diloco import OuterSettings, OuterStep
from paratrain.train.engine import Engine


def outer_step(cfg: RunConfig, engine: Engine, optimizer: Any, mesh: Mesh) -> OuterStep | None:
    """--dp-mode diloco: the outer step over every piece this rank updates, in the order
    checkpoint/state.py's rank_state takes them, across the replica groups (dp_replicate);
    None in any other mode."""
    p = cfg.parallel
    if p.dp_mode != "diloco":
        return None
    pieces = [
        piece.tensors["model"]
        for r, opt in zip(engine.replicas, optimizer.optimizers, strict=True)
        for piece in r.checkpoint_pieces(opt)[0]
    ]
    settings = OuterSettings(p.outer_lr, p.outer_momentum, p.outer_nesterov)

    def after() -> None:
        for r in engine.replicas:
            r.after_load()

    return OuterStep(pieces, mesh.group("dp_replicate"), settings, after)


class OuterSteps:
    """The outer step over every piece this rank updates, across the replica groups
    (dp_replicate): after every --sync-every steps and after the last."""

    def __init__(self, cfg: RunConfig, outer: OuterStep) -> None:
        self.every, self.steps = cfg.parallel.sync_every, cfg.train.steps
        self.checkpoint_every = cfg.train.checkpoint_every
        self.outer, self.synced = outer, -1  # the last `done` that ended on an outer step

    @classmethod
    def of(cls, cfg: RunConfig, optimizer: Any) -> OuterSteps | None:
        """The loop's, over the optimizer's outer step (`outer_step`); None without one."""
        return None if optimizer.outer is None else cls(cfg, optimizer.outer)

    def due(self, done: int) -> bool:
        return done % self.every == 0 or done == self.steps

    def after_step(self, done: int) -> None:
        """After `done` steps: the outer step if it is due."""
        if self.due(done):
            self.sync(done)

    def sync(self, done: int) -> None:
        """End step `done` on an outer step, unless it has one already (a stop's)."""
        if self.synced != done:
            self.outer.step()
            self.synced = done

    def checkpoint_due(self, done: int) -> bool:
        """The last step, and the first outer step at or after each --checkpoint-every
        multiple: a checkpoint holds one model only after an outer step."""
        every = self.checkpoint_every
        crossed = every > 0 and done // every > (done - self.every) // every
        return done == self.steps or (self.due(done) and crossed)
