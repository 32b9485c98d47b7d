"""The training loop: build the model, make it data parallel, step, measure.

`train` is what both the CLI worker and the equivalence tests run, so the numbers that the
tests check are the numbers that users get.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paratrain.config import RunConfig
from paratrain.mesh import Mesh
from paratrain.models.gpt import GPT, GPTConfig
from paratrain.models.plans import GPT_TP_PLAN
from paratrain.parallel.recompute import apply_recomputation
from paratrain.parallel.tensor_parallel import apply_tensor_parallel
from paratrain.train import checkpoint
from paratrain.train.checkpoint import Checkpoint
from paratrain.train.data import BatchSampler, TokenData, validation_batches
from paratrain.train.engine import build_engine
from paratrain.train.optim import learning_rate, scaled_lr
from paratrain.train.wrap import model_state_bytes
from paratrain.validate import parse_straggler

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepMetrics:
    step: int
    loss: float
    lr: float
    tokens_per_s: float
    grad_norm: float
    step_s: float
    compute_s: float  # step time not spent waiting for communication or data
    comm_s: float  # time blocked in collectives (from the ledger)
    data_s: float  # time spent producing this step's batches
    skipped: bool = False  # non-finite gradient norm: no update

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass
class TrainResult:
    model: nn.Module  # the plain model (unwrapped)
    metrics: list[StepMetrics]
    val_loss: float
    extra: dict = field(default_factory=dict)  # model_state_bytes; async: staleness etc.
    engine: Any = None  # what computed the steps (wrappers, runtime), for measurements
    optimizer: Any = None


def gpt_config(cfg: RunConfig) -> GPTConfig:
    m = cfg.model
    return GPTConfig(m.vocab_size, m.n_layer, m.n_head, m.d_model, m.max_seq_len, m.dropout)


def build_model(cfg: RunConfig) -> nn.Module:
    """Every rank builds the full model from the same seed: all layouts start equal."""
    torch.manual_seed(cfg.train.seed)
    return GPT(gpt_config(cfg))


def peak_lr(cfg: RunConfig) -> float:
    t = cfg.train
    return scaled_lr(t.lr, t.global_batch, t.lr_base_batch, t.lr_scaling)


def straggle(cfg: RunConfig, mesh: Mesh, busy_s: float) -> None:
    """Reproduce the seeds' slow worker: sleep so this rank's step takes FACTOR x its work."""
    if not cfg.parallel.straggler:
        return
    rank, factor = parse_straggler(cfg.parallel.straggler, mesh.shape.world_size)
    if mesh.global_rank == rank:
        time.sleep((factor - 1.0) * busy_s)


def train(
    cfg: RunConfig,
    mesh: Mesh,
    data: TokenData,
    on_step: Callable[[StepMetrics], None] | None = None,
    run_dir: Path | None = None,
    resume: Checkpoint | None = None,
    stop: Callable[[], bool] | None = None,
) -> TrainResult:
    """Train for cfg.train.steps steps (from `resume`'s step, if given).

    run_dir: where checkpoints go (every cfg.train.checkpoint_every steps and after the
        last); None saves none.
    stop: asked after every step, collectively (every rank must get the same answer): True
        saves a checkpoint and returns early (preemption).
    """
    if cfg.parallel.dp_mode == "async":
        from paratrain.train.async_loop import train_async  # it builds on this module

        return train_async(cfg, mesh, data, on_step)
    t = cfg.train
    dp = mesh.group("dp")
    # The architecture's order: tensor parallel, then the pipeline split, then data parallel
    # (which must see the final local parameters).
    model = build_model(cfg)
    if mesh.size("tp") > 1:
        apply_tensor_parallel(
            model,
            GPT_TP_PLAN,
            mesh.group("tp"),
            sequence_parallel=cfg.parallel.sequence_parallel,
            seed=t.seed,
        )
    apply_recomputation(model.blocks, t.recompute)  # inside each block, so after TP
    engine = build_engine(model, mesh, cfg)
    # Dropout masks differ between replicas (they see different data) but not between runs.
    torch.manual_seed(t.seed + 7919 * (mesh.global_rank + 1))
    lr = peak_lr(cfg)
    if t.lr_scaling != "none":
        log.info(
            "learning rate %.3g at batch %d, %s scaling to batch %d: %.3g",
            t.lr,
            t.lr_base_batch,
            t.lr_scaling,
            t.global_batch,
            lr,
        )
    optimizer = engine.build_optimizer(cfg, lr)
    first, rewarm = 0, Rewarmup(0, 0)
    if resume is not None:
        saved = checkpoint.load(resume, engine, optimizer, mesh, cfg)
        first = int(saved["step"])
        rewarm = resumed_schedule(saved, cfg, mesh, lr)
        if saved["layout"] != checkpoint.layout_of(cfg, mesh):  # other ranks, other work
            torch.manual_seed(t.seed + 7919 * (mesh.global_rank + 1) + 104729 * first)
    sampler = BatchSampler(data.train, t.seq_len, t.global_batch, t.seed)
    metrics: list[StepMetrics] = []
    skipped_in_a_row, stopped_at = 0, None
    scalers = [w.scaler for w in engine.wrappers if getattr(w, "scaler", None) is not None]

    def save(step: int) -> None:
        if run_dir is not None:
            keep = t.keep_checkpoints
            checkpoint.save(run_dir, step, engine, optimizer, mesh, cfg, data.fingerprint, keep)

    for step in range(first, t.steps):
        start = time.perf_counter()
        micro_batches = sampler.replica_microbatches(step, dp.rank, dp.size, t.micro_batch)
        data_done = time.perf_counter()
        waited_before = mesh.ledger.wait_s()
        mesh.ledger.step = step + 1  # named in hang reports
        step_lr = learning_rate(step, lr, t.warmup_steps, t.steps, t.min_lr_ratio)
        step_lr *= rewarm.factor(step)
        for group in optimizer.param_groups:
            group["lr"] = step_lr
        loss, tokens = engine.forward_backward(micro_batches)
        grad_norm = engine.clip(t.grad_clip)
        # The norm is global (reduced over dp, tp and pp), so every rank decides the same.
        skipped = not math.isfinite(grad_norm)
        if skipped and scalers:  # fp16: an overflow the loss scaler expects and handles
            optimizer.step()  # finds the overflow on every rank, halves the scale, skips
            log.info("step %d: fp16 overflow, loss scale now %g", step + 1, scalers[0].scale)
        elif skipped:
            skipped_in_a_row += 1
            log.warning(
                "step %d skipped: gradient norm %s, loss %s (%d in a row, limit %d)",
                step + 1,
                grad_norm,
                loss,
                skipped_in_a_row,
                t.max_skipped_steps,
            )
            if skipped_in_a_row >= t.max_skipped_steps:
                raise NonFiniteLoss(
                    f"{skipped_in_a_row} consecutive steps (up to step {step + 1}) had a "
                    "non-finite gradient norm; stopping (train.max_skipped_steps = "
                    f"{t.max_skipped_steps}); the last checkpoint is untouched"
                )
        else:
            skipped_in_a_row = 0
            optimizer.step()
        end = time.perf_counter()
        comm_s = mesh.ledger.wait_s() - waited_before
        straggle(cfg, mesh, end - data_done - comm_s)
        end = time.perf_counter()
        step_s = end - start
        m = StepMetrics(
            step=step + 1,
            loss=loss,
            lr=step_lr,
            tokens_per_s=tokens / step_s,
            grad_norm=grad_norm,
            step_s=step_s,
            compute_s=end - data_done - comm_s,
            comm_s=comm_s,
            data_s=data_done - start,
            skipped=skipped,
        )
        metrics.append(m)
        if on_step is not None:
            on_step(m)
        last = step + 1 == t.steps
        if stop is not None and not last and stop():
            log.warning("stop requested: saving a checkpoint after step %d", step + 1)
            save(step + 1)
            stopped_at = step + 1
            break
        if last or (t.checkpoint_every and (step + 1) % t.checkpoint_every == 0):
            save(step + 1)
    # What the rank holds at the step boundary, before evaluation and `finish` change it.
    state = model_state_bytes(engine.wrappers, optimizer)
    extra: dict[str, Any] = {"model_state_bytes": state, "first_step": first + 1}
    val_loss = float("nan")
    if stopped_at is None:
        val = validation_batches(data.val, t.seq_len, t.micro_batch, t.val_batches)
        val_loss = engine.evaluate(val) if val else float("nan")
    else:
        extra["stopped_at"] = stopped_at
    engine.finish()
    model = engine.modules[0] if len(engine.modules) == 1 else nn.ModuleList(engine.modules)
    return TrainResult(model, metrics, val_loss, extra, engine, optimizer)


class NonFiniteLoss(RuntimeError):
    """Too many consecutive steps had a NaN or infinite gradient norm."""


@dataclass(frozen=True)
class Rewarmup:
    """A short linear ramp of the learning rate after resuming on another world size."""

    start: int  # the first step after the resume
    steps: int

    def factor(self, step: int) -> float:
        if self.steps <= 0 or step >= self.start + self.steps:
            return 1.0
        return (step - self.start + 1) / self.steps


def resumed_schedule(saved: dict[str, Any], cfg: RunConfig, mesh: Mesh, lr: float) -> Rewarmup:
    """Log how the resumed run continues; re-warm when the world size changed.

    The global batch is kept (check_compatible refuses another), so only the number of
    micro-batches per replica changes with dp; the peak rate follows from the global batch,
    so it is the same, and is printed with the layouts for the user to see.
    """
    t, before, now = cfg.train, saved["layout"], checkpoint.layout_of(cfg, mesh)
    step = int(saved["step"])
    k_before = t.global_batch // (t.micro_batch * before["dp"])
    k_now = t.global_batch // (t.micro_batch * now["dp"])
    ramp = t.rewarmup_steps if before["world_size"] != now["world_size"] else 0
    log.info(
        "resuming at step %d of %d, saved on %s, now %s; micro-batches per replica per step "
        "%d -> %d (global batch %d kept); peak learning rate %.3g (%s scaling)%s",
        step,
        t.steps,
        _layout_text(before),
        _layout_text(now),
        k_before,
        k_now,
        t.global_batch,
        lr,
        t.lr_scaling,
        f"; world size changed: learning rate re-warmed over {ramp} steps" if ramp else "",
    )
    return Rewarmup(step, ramp)


def _layout_text(layout: dict[str, int]) -> str:
    return "world {world_size} (dp {dp} x pp {pp} x tp {tp}, zero {zero})".format(**layout)
