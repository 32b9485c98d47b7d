"""DiLoCo's outer steps in the training loop (--dp-mode diloco; parallel/diloco.py): when
they are taken, over which fragments, and when a checkpoint may be (only when the groups
hold one model).

Streaming DiLoCo (Douillard et al. 2025, arXiv:2501.18512) with `--fragments p` cuts the
model into p fragments of consecutive blocks (the modules before the blocks go with the
first, those after with the last, a tied head with the token table) and synchronizes
fragment f once per H steps, after step t with t mod H = f H / p (rounded down): the
fragments' traffic is spread over the H steps instead of arriving at once. With
`--sync-delay tau` a fragment's outer step starts after step t and lands tau steps later
(its all-reduce overlapped with those inner steps), and `--merge-alpha a` then sets each
local parameter to a x local + (1 - a) x global instead of the global one. After the last
step (or at a stop) the steps in flight land, every fragment not synchronized there takes
an outer step at once, and every local parameter takes its global value: the run ends on
one model. One fragment, tau 0 and a 0 is DiLoCo itself.
"""

from __future__ import annotations

from typing import Any

from paratrain.config import RunConfig
from paratrain.mesh import Mesh
from paratrain.models.plans import ModelPlan
from paratrain.parallel.diloco import OuterSettings, OuterStep, Started
from paratrain.train.build import plan_of
from paratrain.train.engine import Engine


def outer_step(cfg: RunConfig, engine: Engine, optimizer: Any, mesh: Mesh) -> OuterStep | None:
    """--dp-mode diloco: the outer step over every piece this rank updates, in the order
    checkpoint/state.py's rank_state takes them, across the replica groups (dp_replicate);
    None in any other mode."""
    p = cfg.parallel
    if p.dp_mode != "diloco":
        return None
    pieces = [
        piece
        for r, opt in zip(engine.replicas, optimizer.optimizers, strict=True)
        for piece in r.checkpoint_pieces(opt)[0]
    ]
    settings = OuterSettings(p.outer_lr, p.outer_momentum, p.outer_nesterov, p.outer_dtype)

    def after() -> None:
        for r in engine.replicas:
            r.after_load()

    values, names = [q.tensors["model"] for q in pieces], [q.name for q in pieces]
    return OuterStep(values, mesh.group("dp_replicate"), settings, after, names)


def fragment_of(name: str, plan: ModelPlan, n_layer: int, fragments: int, tied: bool) -> int:
    """The fragment of parameter `name` (module docstring): block i of L in fragment
    i p // L; the modules before the blocks in the first, those after in the last, but a
    head tied to the token table with it (the two copies on a pipeline's ends must move
    together)."""
    head, _, rest = name.partition(".")
    if head == plan.pipeline_blocks:
        return int(rest.split(".")[0]) * fragments // n_layer
    if head in plan.pipeline_last and not (tied and head == "head"):
        return fragments - 1
    return 0


class OuterSteps:
    """The outer steps over the fragments of every piece this rank updates, across the
    replica groups (dp_replicate)."""

    def __init__(self, cfg: RunConfig, outer: OuterStep, fragments: list[list[int]]) -> None:
        p = cfg.parallel
        self.every, self.steps = p.sync_every, cfg.train.steps
        self.delay, self.merge = p.sync_delay, p.merge_alpha
        self.checkpoint_every = cfg.train.checkpoint_every
        self.outer, self.fragments = outer, fragments  # per fragment, its pieces' indices
        self.offsets = [f * self.every // len(fragments) for f in range(len(fragments))]
        # outer steps in flight (--sync-delay): the step after which each lands, its
        # fragments, its call; and the last step's synchronized fragments
        self.pending: list[tuple[int, list[int], Started]] = []
        self.synced: tuple[int, set[int]] = (-1, set())

    @classmethod
    def of(cls, cfg: RunConfig, optimizer: Any) -> OuterSteps | None:
        """The loop's, over the optimizer's outer step (`outer_step`); None without one."""
        outer = optimizer.outer
        if outer is None:
            return None
        p, m = cfg.parallel.fragments, cfg.model
        plan = plan_of(cfg)
        fragments: list[list[int]] = [[] for _ in range(p)]
        for i, name in enumerate(outer.names):
            fragments[fragment_of(name, plan, m.n_layer, p, m.tie_embeddings)].append(i)
        return cls(cfg, outer, fragments)

    def due_fragments(self, done: int) -> list[int]:
        """The fragments whose outer step starts after `done` steps: each at its offset
        once per H; every one after the last step (`sync`)."""
        if done == self.steps:
            return list(range(len(self.fragments)))
        return [f for f, offset in enumerate(self.offsets) if done % self.every == offset]

    def due(self, done: int) -> bool:
        """Whether every fragment is synchronized after `done` steps (one model again)."""
        return len(self.due_fragments(done)) == len(self.fragments)

    def after_step(self, done: int) -> None:
        """After `done` steps: the outer steps landing now (merged by --merge-alpha), then
        those due start, in one call, landing --sync-delay steps later; the last step
        ends the run on one model (`sync`)."""
        if done == self.steps:
            self.sync(done)
            return
        landed = []
        for _, fragments, started in self._landing(done):
            self.outer.finish(started, self.merge)
            landed += fragments
        due = self.due_fragments(done)
        if due:
            started = self.outer.start(self._pieces(due))
            if self.delay:
                self.pending.append((done + self.delay, due, started))
            else:
                self.outer.finish(started, self.merge)
                landed += due
        self.synced = (done, set(landed))

    def sync(self, done: int) -> None:
        """End step `done` on one model (the last step, or a stop): the outer steps in
        flight land, every fragment not synchronized at this step takes one at once, every
        local piece takes its global value, and the wrappers rebuild their copies once."""
        landed = set(self.synced[1]) if self.synced[0] == done else set()
        for _, fragments, started in self._landing(None):
            self.outer.finish(started, self.merge, rebuild=False)
            landed |= set(fragments)
        rest = [f for f in range(len(self.fragments)) if f not in landed]
        if rest:
            self.outer.step(self._pieces(rest), rebuild=False)
        if self.merge or landed:
            self.outer.take_global()
        if rest or landed:
            self.outer.after()
        self.synced = (done, set(range(len(self.fragments))))

    def _landing(self, done: int | None) -> list[tuple[int, list[int], Started]]:
        """The outer steps in flight that land after `done` steps (None: all), removed."""
        landing = [p for p in self.pending if done is None or p[0] == done]
        self.pending = [p for p in self.pending if p not in landing]
        return landing

    def _pieces(self, fragments: list[int]) -> list[int]:
        return [i for f in fragments for i in self.fragments[f]]

    def checkpoint_due(self, done: int) -> bool:
        return checkpoint_after(done, self.due(done), self.checkpoint_every, self.every, self.steps)


def checkpoint_after(done: int, synced: bool, every: int, h: int, steps: int) -> bool:
    """After `done` of `steps` steps, `synced` (the groups hold one model): the last step,
    and the first whole outer step at or after each --checkpoint-every multiple `every`
    (H = `h` steps apart): a checkpoint holds one model only after one."""
    crossed = every > 0 and done // every > (done - h) // every
    return done == steps or (synced and crossed)
