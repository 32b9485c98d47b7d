"""The training loop of synchronous runs: build, step, measure, checkpoint, evaluate.

`train` is what both the CLI worker and the equivalence tests run, so the numbers that the
tests check are the numbers that users get. Asynchronous (parameter-server) runs have
their own loop, train/async_loop.py, chosen by the caller (train/worker.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paratrain import checkpoint
from paratrain.checkpoint import Checkpoint
from paratrain.config import RunConfig, TrainConfig
from paratrain.data.document_rows import training_rows, validation_rows
from paratrain.data.supervised import run_row_layout
from paratrain.data.tokens import TokenData, on_device
from paratrain.mesh import Mesh
from paratrain.train.build import build_engine, build_model, seed_rank_stream
from paratrain.train.diloco import OuterSteps, outer_step
from paratrain.train.engine import Engine
from paratrain.train.metrics import StepMetrics, StepTimer, TrainResult
from paratrain.train.optim import LrSchedule, Rewarmup, muon_settings, peak_lr
from paratrain.train.resume import restore
from paratrain.train.step import SkippedSteps, train_step
from paratrain.train.straggler import straggle

log = logging.getLogger(__name__)


def train(
    cfg: RunConfig,
    mesh: Mesh,
    data: TokenData,
    on_step: Callable[[StepMetrics], None] | None = None,
    run_dir: Path | None = None,
    resume: Checkpoint | None = None,
    stop: Callable[[], bool] | None = None,
    on_start: Callable[[Engine], None] | None = None,
) -> TrainResult:
    """Train for cfg.train.steps steps (from `resume`'s step, if given).

    run_dir: where checkpoints go (every cfg.train.checkpoint_every steps and after the
        last); None saves none.
    stop: asked after every step, collectively (every rank must get the same answer): True
        saves a checkpoint and returns early (preemption).
    on_start: called with the engine before the first step (measurements attach here).
    """
    assert cfg.parallel.dp_mode != "async", "the parameter server's: train/async_loop.py"
    t = cfg.train
    layout = run_row_layout(cfg, data.supervised)  # the rows --packing cuts
    engine, optimizer, first, lr = build_training(cfg, mesh, resume, layout == "documents")
    outer = OuterSteps.of(cfg, optimizer)  # DiLoCo's, else None
    if on_start is not None:
        on_start(engine)
    sampler = training_rows(data, layout, t.seq_len, t.global_batch, t.seed)
    compiled = engine.compiled
    timer = StepTimer(mesh.ledger, (lambda: compiled.seconds) if compiled else None)
    dp, skips = mesh.group("dp"), SkippedSteps(t.max_skipped_steps)
    metrics: list[StepMetrics] = []
    stopped_at = None
    for step in range(first, t.steps):
        timer.start(step)
        mine = sampler.replica_microbatches(step, dp.rank, dp.size, t.micro_batch)
        micro_batches = on_device(mine, mesh.device)
        timer.data_done()
        out = train_step(engine, optimizer, micro_batches, lr(step), t.grad_clip)
        skips.record(step, out)
        if outer is not None:
            outer.after_step(step + 1)
        straggle(cfg, mesh.global_rank, mesh.shape.world_size, timer.busy_s())
        metrics.append(timer.finish(step, out, lr(step)))
        if compiled is not None and step == first:
            log.info("%s", compiled.report().line())  # what the first step compiled
        if on_step is not None:
            on_step(metrics[-1])
        if stop is not None and step + 1 < t.steps and stop():  # not after the last
            # the user is told once, by the stop's line, which names this checkpoint
            log.debug("stop requested: saving a checkpoint after step %d", step + 1)
            stopped_at = step + 1
            if outer is not None:  # so that the checkpoint holds one model
                outer.sync(step + 1)
        due = outer.checkpoint_due(step + 1) if outer else checkpoint_due(step + 1, t)
        if run_dir is not None and (stopped_at or due):
            keep, fingerprint, announce = t.keep_checkpoints, data.fingerprint, not stopped_at
            checkpoint.save(run_dir, step + 1, engine, optimizer, mesh, cfg, fingerprint, keep,
                            announce=announce)  # fmt: skip
        if stopped_at:
            break
    return finish_training(cfg, engine, optimizer, data, metrics, first, stopped_at, mesh.device)


def build_training(
    cfg: RunConfig, mesh: Mesh, resume: Checkpoint | None, packed: bool
) -> tuple[Engine, Any, int, LrSchedule]:
    """This rank's engine and optimizer, at `resume`'s step if given: (engine, optimizer,
    the first step to run, the learning-rate schedule). packed: rows of packed documents."""
    t = cfg.train
    # --init-from's weights, unless a checkpoint is about to replace them
    model = build_model(cfg, mesh.device, initial=resume is None)
    engine = build_engine(cfg, mesh, model=model, packed=packed)
    seed_rank_stream(t.seed, mesh.global_rank)
    betas, muon = (t.beta1, t.beta2), muon_settings(cfg)
    sgd = t.optimizer == "sgd"
    optimizer = engine.build_optimizer(peak_lr(cfg), t.weight_decay, betas, muon=muon, sgd=sgd)
    optimizer.outer = outer_step(cfg, engine, optimizer, mesh)  # DiLoCo's; before a load
    first, rewarm = 0, Rewarmup()
    if resume is not None:
        first, rewarm = restore(resume, engine, optimizer, mesh, cfg, peak_lr(cfg))
    return engine, optimizer, first, LrSchedule.of(cfg, rewarm)


def checkpoint_due(done: int, t: TrainConfig) -> bool:
    """After `done` steps: the last step, and every t.checkpoint_every (0: never)."""
    return done == t.steps or (t.checkpoint_every > 0 and done % t.checkpoint_every == 0)


def finish_training(
    cfg: RunConfig,
    engine: Engine,
    optimizer: Any,
    data: TokenData,
    metrics: list[StepMetrics],
    first: int,
    stopped_at: int | None,
    device: torch.device,
) -> TrainResult:
    """Evaluate (unless stopped early), leave the model whole, and report."""
    t = cfg.train
    # What the rank holds at the step boundary, before evaluation and `finish` change it.
    extra: dict[str, Any] = {"model_state_bytes": engine.memory_report(optimizer)}
    extra["first_step"] = first + 1
    if engine.compiled is not None:
        extra["compile"] = engine.compiled.report().as_dict()
    val_loss = float("nan")
    if stopped_at is None:
        layout = run_row_layout(cfg, data.supervised)
        val = on_device(
            validation_rows(data, layout, t.seq_len, t.micro_batch, t.val_batches), device
        )
        val_loss = engine.evaluate(val) if val else float("nan")
    else:
        extra["stopped_at"] = stopped_at
    engine.finish()
    modules = engine.modules
    model = modules[0] if len(modules) == 1 else nn.ModuleList(modules)
    return TrainResult(model, metrics, val_loss, extra, engine, optimizer)
