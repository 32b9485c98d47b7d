"""`--dp-mode async`: the training loop for the parameter server and its workers.

The same samples as synchronous training: with W workers, batch index i is rows
[(i mod W) * G / W, ...) of step (i div W)'s global batch, and a run of `steps` steps is
W * steps updates. One "step" of metrics is W consecutive updates (G sequences), so loss
curves of sync and async runs line up by samples seen.

Checkpoints, resume and preemption mirror the synchronous loop (train/loop.py), at step
boundaries, that is every W updates: the server saves its model, AdamW state, version and
each worker's batch (checkpoint/server.py) every --checkpoint-every steps, after the
last, and when asked to stop. The workers are never in lockstep, so a stop is not agreed
by a collective as in train/preemption.py: each rank reads its own SIGTERM flag, a
worker's rides to the server in its next push header, and the server, having seen either,
saves at the next step boundary and answers every worker's next push with STOP (those
gradients are not applied; their batches are assigned again on resume).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from paratrain.checkpoint import Checkpoint
from paratrain.checkpoint.server import load_server, save_server
from paratrain.config import RunConfig
from paratrain.data.document_rows import training_rows, validation_rows
from paratrain.data.supervised import run_row_layout
from paratrain.data.tokens import TokenData, on_device
from paratrain.mesh import Mesh
from paratrain.parallel.context_parallel import TokenShard
from paratrain.parallel.data_parallel import DataParallel
from paratrain.parallel.data_parallel.adamw import adamw
from paratrain.parallel.data_parallel.async_sgd import ParameterServer, serve, work
from paratrain.parallel.data_parallel.async_state import ServerReport, ServerState, Update
from paratrain.parallel.data_parallel.whole_module import WholeGradients
from paratrain.train.build import build_model, recompute_blocks, seed_rank_stream
from paratrain.train.clip import clip_to, global_grad_norm
from paratrain.train.engine import FlatEngine
from paratrain.train.metrics import StepMetrics, TrainResult
from paratrain.train.microbatch_passes import evaluate
from paratrain.train.optim import LrSchedule
from paratrain.train.straggler import straggle

log = logging.getLogger(__name__)


def train_async(
    cfg: RunConfig,
    mesh: Mesh,
    data: TokenData,
    on_step: Callable[[StepMetrics], None] | None = None,
    run_dir: Path | None = None,
    resume: Checkpoint | None = None,
    stop: Callable[[], bool] | None = None,
) -> TrainResult:
    """Serve (group rank 0) or work (the others) for cfg.train.steps steps, from `resume`'s
    step if given.

    run_dir: where the server saves checkpoints (every cfg.train.checkpoint_every steps
        and after the last); None saves none.
    resume: the checkpoint the server continues from; the workers need nothing from it.
    stop: asked on each rank by itself, with no communication (unlike train's): True on
        any rank stops the run at the next step boundary, with a checkpoint.
    """
    group = mesh.group("dp")
    # Same seed everywhere: workers start from the server's weights (--init-from's,
    # unless a checkpoint is about to replace them).
    model = build_model(cfg, mesh.device, initial=resume is None)
    if group.rank == 0:
        server = _Server(cfg, mesh, data, on_step, run_dir, stop)
        return server.run(model, resume)
    _work(cfg, mesh, model, data, stop)
    return TrainResult(model=model, metrics=[], val_loss=float("nan"))


class _Server:
    """The server's side of the loop: serve, and at every step boundary log the step's
    metrics and save a checkpoint when due, last or stopping."""

    def __init__(
        self,
        cfg: RunConfig,
        mesh: Mesh,
        data: TokenData,
        on_step: Callable[[StepMetrics], None] | None,
        run_dir: Path | None,
        stop: Callable[[], bool] | None,
    ) -> None:
        self.cfg, self.mesh, self.data = cfg, mesh, data
        self.on_step, self.run_dir, self.stop = on_step, run_dir, stop
        self.workers = mesh.group("dp").size - 1
        self.lr = LrSchedule.of(cfg)  # per step of W updates, as in synchronous training
        self.metrics: list[StepMetrics] = []
        self.chunk: list[Update] = []  # the current step's updates so far
        self.previous_end = 0.0  # when the last step ended, on the server's clock
        self.stopped_at: int | None = None

    def run(self, model: nn.Module, resume: Checkpoint | None) -> TrainResult:
        t, p = self.cfg.train, self.cfg.parallel
        optimizer = adamw(model, self.lr.peak, t.weight_decay, (t.beta1, t.beta2))
        pushed = WholeGradients(model)

        def set_lr(update: int) -> None:
            for g in optimizer.param_groups:
                g["lr"] = self.lr(update // self.workers)

        def clip() -> float:  # the one global norm; the server holds the whole model
            norm = global_grad_norm([pushed.grad_squares()], tp_split=())
            clip_to([pushed], norm, t.grad_clip)
            return norm

        start = None if resume is None else self._resume(resume, model, optimizer)
        first = 0 if start is None else start.version // self.workers
        group = self.mesh.group("dp")
        report = serve(
            model, optimizer, group, self.mesh.control, t.steps * self.workers, set_lr, clip,
            p.dc_lambda, p.staleness_bound, dc_mode=p.dc_mode, dc_decay=p.dc_decay,
            start=start, after_update=self.after_update,
        )  # fmt: skip
        extra = {"async": async_summary(report), "first_step": first + 1, "report": report}
        val_loss = float("nan")
        if self.stopped_at is None:
            layout = run_row_layout(self.cfg, self.data.supervised)
            val = validation_rows(self.data, layout, t.seq_len, t.micro_batch, t.val_batches)
            val = on_device(val, self.mesh.device)
            split = TokenShard(packed=layout == "documents")
            alone = group.alone("server")
            val_loss = evaluate(model, val, alone, split) if val else float("nan")
        else:
            extra["stopped_at"] = self.stopped_at
        return TrainResult(model, self.metrics, val_loss, extra, optimizer=optimizer)

    def _resume(
        self, ckpt: Checkpoint, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> ServerState:
        state = load_server(ckpt, model, optimizer, self.mesh, self.cfg)
        log.info(
            "resuming at step %d of %d (update %d): batches %s handed to workers %s again",
            state.version // self.workers, self.cfg.train.steps, state.version,
            list(state.assigned.values()), list(state.assigned),
        )  # fmt: skip
        return state

    def after_update(self, server: ParameterServer) -> bool:
        """Called by `serve` after each update; True stops the run (after a checkpoint)."""
        self.chunk.append(server.report.updates[-1])
        if server.state.version % self.workers:
            return False
        step, t = server.state.version // self.workers, self.cfg.train
        self.metrics.append(self._step_metrics(step))
        if self.on_step is not None:
            self.on_step(self.metrics[-1])
        last = step >= t.steps
        asked = server.stop_asked or (self.stop is not None and self.stop())
        if asked and not last:
            # the user is told once, by the stop's line, which names this checkpoint
            log.debug("stop requested: saving a checkpoint after step %d", step)
            self.stopped_at = step
        due = t.checkpoint_every > 0 and step % t.checkpoint_every == 0
        if self.run_dir is not None and (last or self.stopped_at or due):
            fingerprint, keep = self.data.fingerprint, t.keep_checkpoints
            announce = self.stopped_at is None
            save_server(
                self.run_dir, step, server, self.mesh, self.cfg, fingerprint, keep, announce
            )
        return self.stopped_at is not None

    def _step_metrics(self, step: int) -> StepMetrics:
        """One step's metrics from its W updates (the loss token-weighted, as in sync)."""
        chunk, self.chunk = self.chunk, []
        tokens = sum(u.tokens for u in chunk)
        end = chunk[-1].time_s
        elapsed = max(end - self.previous_end, 1e-9)
        self.previous_end = end
        return StepMetrics(
            step=step,
            loss=sum(u.loss * u.tokens for u in chunk) / max(tokens, 1.0),
            lr=self.lr(step - 1),
            tokens_per_s=tokens / elapsed,
            grad_norm=statistics.fmean(u.grad_norm for u in chunk),
            step_s=elapsed,
            compute_s=0.0,  # the server only applies updates; workers' time is their own
            comm_s=elapsed,
            data_s=0.0,
        )


def async_summary(report: ServerReport) -> dict:
    """The server's updates since it started (a resumed run: since the resume)."""
    staleness = [u.staleness for u in report.updates]
    histogram: dict[int, int] = {}
    for s in staleness:
        histogram[s] = histogram.get(s, 0) + 1
    return {
        "updates": len(report.updates),
        "dropped": report.dropped,
        "compensation": report.compensation,
        "pushes_by_worker": report.pushes_by_worker(),
        "staleness_mean": statistics.fmean(staleness) if staleness else 0.0,
        "staleness_max": max(staleness, default=0),
        "staleness_histogram": dict(sorted(histogram.items())),
    }


def _work(
    cfg: RunConfig,
    mesh: Mesh,
    model: nn.Module,
    data: TokenData,
    stop: Callable[[], bool] | None,
) -> None:
    """A worker: the same token-weighted passes as synchronous training, on a replica of
    one process (its gradient goes to the server, not to other workers)."""
    t, group = cfg.train, mesh.group("dp")
    workers = group.size - 1
    layout = run_row_layout(cfg, data.supervised)  # the rows --packing cuts
    sampler = training_rows(data, layout, t.seq_len, t.global_batch, t.seed)
    per_update = t.global_batch // workers
    recompute_blocks(model, cfg)  # as build_engine applies it, before the wrapper
    replica = DataParallel(model, group.alone("worker"), reduce_op="sum")
    engine = FlatEngine(replica, split=TokenShard(packed=layout == "documents"))

    def compute(batch_index: int) -> tuple[float, float]:
        start = time.perf_counter()
        # Dropout draws from a stream of (worker, batch): a batch handed out again after a
        # resume gets the masks it would have had, with no random state to checkpoint.
        seed_rank_stream(t.seed, mesh.global_rank, batch_index)
        step, part = divmod(batch_index, workers)
        rows = sampler.global_batch_at(step)[part * per_update : (part + 1) * per_update]
        micro_batches = on_device(list(rows.split(t.micro_batch)), mesh.device)
        loss, tokens = engine.forward_backward(micro_batches)
        engine.settle_grads()  # the server clips the mean gradient it is pushed
        straggle(cfg, mesh.global_rank, mesh.shape.world_size, time.perf_counter() - start)
        return loss, float(tokens)

    work(model, group, mesh.control, compute, stop=stop)
