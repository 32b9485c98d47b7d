"""`--dp-mode async`: the training loop for the parameter server and its workers.

The same samples as synchronous training: with W workers, update i takes rows
[(i mod W) * G / W, ...) of step (i div W)'s global batch, and a run of `steps` steps is
W * steps updates. One "step" of metrics is W consecutive updates (G sequences), so loss
curves of sync and async runs line up by samples seen.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from paratrain.config import RunConfig
from paratrain.mesh import Mesh
from paratrain.parallel.adamw import adamw
from paratrain.parallel.async_sgd import ServerReport, serve, work
from paratrain.parallel.data_parallel import DataParallel
from paratrain.parallel.replica import WholeGradients
from paratrain.train.build import build_model, seed_rank_stream
from paratrain.train.clip import clip_to, global_grad_norm
from paratrain.train.data import BatchSampler, TokenData, on_device, validation_batches
from paratrain.train.engine import FlatEngine
from paratrain.train.metrics import StepMetrics, TrainResult
from paratrain.train.optim import LrSchedule
from paratrain.train.passes import evaluate
from paratrain.train.straggler import straggle


def train_async(
    cfg: RunConfig,
    mesh: Mesh,
    data: TokenData,
    on_step: Callable[[StepMetrics], None] | None = None,
) -> TrainResult:
    group = mesh.group("dp")
    # Same seed everywhere: workers start from the server's weights.
    model = build_model(cfg, mesh.device)
    if group.rank == 0:
        return _serve(cfg, (group, mesh.control), model, data, on_step)
    _work(cfg, mesh, group, model, data)
    return TrainResult(model=model, metrics=[], val_loss=float("nan"))


def _serve(cfg, groups, model, data, on_step) -> TrainResult:
    (group, control), t = groups, cfg.train
    workers = group.size - 1
    lr = LrSchedule.of(cfg)  # per step of W updates, as in synchronous training
    optimizer = adamw(model, lr.peak, t.weight_decay, (t.beta1, t.beta2))

    def set_lr(update: int) -> None:
        for g in optimizer.param_groups:
            g["lr"] = lr(update // workers)

    pushed = WholeGradients(model)

    def clip() -> float:  # the one global norm; the server holds the whole model
        norm = global_grad_norm([pushed.grad_squares()], tp_split=())
        clip_to([pushed], norm, t.grad_clip)
        return norm

    p = cfg.parallel
    report = serve(
        model,
        optimizer,
        group,
        control,
        t.steps * workers,
        set_lr,
        clip,
        p.dc_lambda,
        p.staleness_bound,
        dc_mode=p.dc_mode,
        dc_decay=p.dc_decay,
    )
    metrics = _step_metrics(report, workers, lr)
    for m in metrics:
        if on_step is not None:
            on_step(m)
    device = next(model.parameters()).device
    val = on_device(validation_batches(data.val, t.seq_len, t.micro_batch, t.val_batches), device)
    val_loss = evaluate(model, val, group.alone("server")) if val else float("nan")
    return TrainResult(
        model=model, metrics=metrics, val_loss=val_loss, extra={"async": async_summary(report)}
    )


def async_summary(report: ServerReport) -> dict:
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


def _step_metrics(report: ServerReport, workers: int, lr: LrSchedule) -> list[StepMetrics]:
    metrics, previous_end = [], 0.0
    for step in range(len(report.updates) // workers):
        chunk = report.updates[step * workers : (step + 1) * workers]
        tokens = sum(u.tokens for u in chunk)
        end = chunk[-1].time_s
        elapsed = max(end - previous_end, 1e-9)
        metrics.append(
            StepMetrics(
                step=step + 1,
                loss=sum(u.loss * u.tokens for u in chunk) / max(tokens, 1.0),
                lr=lr(step),
                tokens_per_s=tokens / elapsed,
                grad_norm=statistics.fmean(u.grad_norm for u in chunk),
                step_s=elapsed,
                compute_s=0.0,  # the server only applies updates; workers' time is their own
                comm_s=elapsed,
                data_s=0.0,
            )
        )
        previous_end = end
    return metrics


def _work(cfg, mesh, group, model, data) -> None:
    """A worker: the same token-weighted passes as synchronous training, on a replica of
    one process (its gradient goes to the server, not to other workers)."""
    t, workers = cfg.train, group.size - 1
    sampler = BatchSampler(data.train, t.seq_len, t.global_batch, t.seed)
    per_update = t.global_batch // workers
    seed_rank_stream(t.seed, mesh.global_rank)
    engine = FlatEngine(DataParallel(model, group.alone("worker"), reduce_op="sum"))

    def compute(batch_index: int) -> tuple[float, float]:
        start = time.perf_counter()
        step, part = divmod(batch_index, workers)
        rows = sampler.global_batch_at(step)[part * per_update : (part + 1) * per_update]
        micro_batches = on_device(list(rows.split(t.micro_batch)), mesh.device)
        loss, tokens = engine.forward_backward(micro_batches)
        straggle(cfg, mesh.global_rank, mesh.shape.world_size, time.perf_counter() - start)
        return loss, float(tokens)

    work(model, group, mesh.control, compute)
