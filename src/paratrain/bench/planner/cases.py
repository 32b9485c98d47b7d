"""The cases `paratrain plan --validate` runs, and how each becomes a real training run.

A case is a layout (plan/layout.py) with K micro-batches of MICRO_BATCH sequences per
replica; `small_config` turns it into the RunConfig that `paratrain.train.loop.train`
runs in gloo processes (`record.run_case`), and plan/run_inputs.py's `planner_inputs` (the
conversion `paratrain train`'s prediction uses) into the planner's inputs for the same
run. run.py compares the two, row by row.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from paratrain.config import RunConfig
from paratrain.models.presets import preset
from paratrain.plan.layout import Layout
from paratrain.plan.rank_experts import ExpertCounts

TIMEOUT_S = 600.0
MICRO_BATCH = 2
SLOW_UNIT_S = 0.08  # a pipeline's sleep per forward (a backward: 2, or 1 per split pass)


@dataclass(frozen=True)
class Row:
    case: str
    quantity: str
    predicted: float
    measured: float
    exact: bool = True  # deterministic: must be equal
    note: str = ""
    ranks: str = ""  # which ranks the row stands for, e.g. "0,1" (rows merge across ranks)
    bounds: tuple[float, float] | None = None  # not exact, but measured must lie within

    @property
    def checked(self) -> bool:
        return self.exact or self.bounds is not None

    @property
    def ok(self) -> bool:
        if self.bounds is not None:
            return self.bounds[0] <= self.measured <= self.bounds[1]
        return self.predicted == self.measured if self.exact else True


@dataclass(frozen=True)
class Case:
    """One layout to validate, with K micro-batches of MICRO_BATCH sequences per replica."""

    name: str
    layout: Layout
    microbatches: int
    zero2_accumulate: str = "shard"  # parallel.zero2_accumulate (its default), for ZeRO-2
    model: str = ""  # a `train --model` preset instead of our default GPT (experts: moe-tiny)


CASES = {
    c.name: c
    for c in (
        Case("dp", Layout(dp=2), 2),
        Case("tp", Layout(tp=2), 2),
        Case("gpipe", Layout(pp=2, schedule="gpipe"), 4),
        Case("1f1b", Layout(pp=2, schedule="1f1b"), 4),
        Case("interleaved", Layout(pp=2, schedule="interleaved", chunks=2), 4),
        Case("3d", Layout(dp=2, pp=2, tp=2, schedule="1f1b"), 4),
        Case("zero1", Layout(dp=2, zero=1), 2),
        Case("zero2-full", Layout(dp=2, zero=2), 2, "full"),
        Case("zero2-shard", Layout(dp=2, zero=2), 2, "shard"),
        Case("zero3", Layout(dp=2, zero=3), 2),
        Case("zero3-dp3", Layout(dp=3, zero=3), 2),
        Case("zero3-tp", Layout(dp=2, tp=2, zero=3), 2),
        Case("zero1-pp", Layout(dp=2, pp=2, zero=1, schedule="1f1b"), 4),
        Case(
            "zero2-full-pp", Layout(dp=2, pp=2, zero=2, schedule="interleaved", chunks=2), 4, "full"
        ),
        Case("zero2-shard-pp", Layout(dp=2, pp=2, zero=2, schedule="1f1b"), 4, "shard"),
        Case("zb-h1", Layout(pp=2, schedule="zb-h1"), 4),
        Case("cp", Layout(cp=2), 2),
        Case("cp-a2a", Layout(cp=2, cp_method="alltoall", zero=1), 2),
        Case("ep", Layout(dp=2, ep=2), 2, model="moe-tiny"),
    )
}


def small_config(case: Case, steps: int) -> RunConfig:
    """Our default GPT, a few short steps: big enough to be a real run, quick on CPU."""
    from paratrain.validate import resolve_and_check

    lay, cfg = case.layout, RunConfig()
    if case.model:
        cfg.model = replace(cfg.model, **preset(case.model), name=case.model)
    p, t = cfg.parallel, cfg.train
    p.nproc, p.dp, p.pp, p.tp, p.zero = lay.world, lay.dp, lay.pp, lay.tp, lay.zero
    p.cp, p.cp_method, p.ep = lay.cp, lay.cp_method, lay.ep
    p.zero2_accumulate = case.zero2_accumulate
    p.schedule, p.chunks, p.backend = lay.schedule or "1f1b", lay.chunks, "gloo"
    p.bucket_mb = 0  # one bucket per chunk: one gradient all-reduce each
    t.steps, t.warmup_steps, t.val_batches, t.dtype = steps, 1, 0, "float32"
    t.micro_batch, t.microbatches = MICRO_BATCH, case.microbatches
    t.global_batch = case.microbatches * MICRO_BATCH * lay.dp
    return resolve_and_check(cfg, lay.world)


def experts_of(cfg: RunConfig) -> ExpertCounts | None:
    return ExpertCounts.of(cfg.model)
