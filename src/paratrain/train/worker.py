"""What each worker process runs: join the process group, build the mesh, train, record."""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from paratrain import checkpoint, comm
from paratrain.comm.algos import algorithms_line
from paratrain.comm.group import CommOptions
from paratrain.config import RunConfig, device_type
from paratrain.data.tokens import TokenData, keep_tokenizer, load_tokens
from paratrain.mesh import Mesh
from paratrain.train import run_dir as rd
from paratrain.train.async_loop import train_async
from paratrain.train.build import count_params
from paratrain.train.cuda_memory import cuda_memory
from paratrain.train.loop import train
from paratrain.train.metrics import TrainResult
from paratrain.train.optim import warmup_note
from paratrain.train.pipeline_trace import record_trace
from paratrain.train.prediction_tracker import PredictionTracker
from paratrain.train.preemption import Preemption, StoppedAtOnce
from paratrain.train.progress import Progress
from paratrain.train.provenance import end_start, write_provenance
from paratrain.train.tensorboard import TensorBoardWriter

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerEnv:
    """Facts about this process that the CLI read from the launcher's environment."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    use_env_rendezvous: bool  # False: one process, no launcher (an in-memory store)
    restart_count: int = 0  # the launcher's restarts so far (TORCHELASTIC_RESTART_COUNT)
    agent_store: str = ""  # HOST:PORT of the elastic agent's store, when workers share it


# NCCL's own watchdog tears the process down when a collective outlives the process
# group's timeout; ours (comm/wait.py) must report first, naming the rank and the call.
NCCL_TIMEOUT_MARGIN_S = 60.0


def rank_device(cfg: RunConfig, env: WorkerEnv) -> torch.device:
    """cuda:LOCAL_RANK with --device cuda (one GPU per local rank), else the CPU."""
    if device_type(cfg) == "cuda":
        return torch.device("cuda", env.local_rank)
    return torch.device("cpu")


def init_process_group(cfg: RunConfig, env: WorkerEnv) -> None:
    timeout = timedelta(seconds=cfg.parallel.comm_timeout_s)
    if cfg.parallel.backend == "nccl":
        torch.cuda.set_device(rank_device(cfg, env))
        timeout += timedelta(seconds=NCCL_TIMEOUT_MARGIN_S)
    store: dist.Store
    if env.use_env_rendezvous and env.agent_store and env.restart_count > 0:
        # The agent's store outlives a restart: without a prefix per attempt, a restarted
        # rank can read a dead rank's gloo address left by the previous attempt.
        host, port = env.agent_store.rsplit(":", 1)
        client = dist.TCPStore(host, int(port), env.world_size, is_master=False, timeout=timeout)
        store = dist.PrefixStore(f"paratrain/attempt_{env.restart_count}", client)
        dist.init_process_group(
            cfg.parallel.backend,
            store=store,
            rank=env.rank,
            world_size=env.world_size,
            timeout=timeout,
        )
    elif env.use_env_rendezvous:
        dist.init_process_group(cfg.parallel.backend, timeout=timeout)
    else:
        store = dist.HashStore()
        dist.init_process_group(
            cfg.parallel.backend, store=store, rank=0, world_size=1, timeout=timeout
        )


def _share_run_dir(cfg: RunConfig, mesh: Mesh, prepared: bool) -> Path:
    """Rank 0 makes (or was handed) the run directory; every rank learns it, or the error."""
    answer: str | ValueError | None = None
    if mesh.global_rank == 0:
        try:
            t = cfg.train
            answer = t.out if prepared else str(rd.worker_run_dir(t.out, t.resume))
        except ValueError as e:
            answer = e
    answer = comm.broadcast_object(answer, mesh.control)
    if isinstance(answer, ValueError):
        raise answer
    return Path(answer)


def run_summary(result: TrainResult, cfg: RunConfig, run_dir: Path) -> dict[str, Any]:
    """The run's summary: losses and step counts of the whole run (metrics.jsonl, also the
    steps before a resume); speed and times of this start alone (another start may have
    had another layout)."""
    metrics = rd.read_step_metrics(run_dir)
    first = result.extra.get("first_step", 1)
    this_start = [m for m in metrics if m.step >= first] or metrics
    steady = this_start[1:] or this_start  # the first step pays for warm-up allocations
    resumed = first > 1
    return {
        "initial_loss": metrics[0].loss,
        "final_loss": metrics[-1].loss,
        "val_loss": result.val_loss,
        "steps": len(metrics),
        "skipped_steps": sum(m.skipped for m in metrics),
        **({"resumed_at_step": result.extra["first_step"] - 1} if resumed else {}),
        **({"stopped_at_step": result.extra["stopped_at"]} if "stopped_at" in result.extra else {}),
        "world_size": cfg.world_size,
        "device": cfg.parallel.device,
        "dp": cfg.parallel.dp,
        "pp": cfg.parallel.pp,
        "tp": cfg.parallel.tp,
        "cp": cfg.parallel.cp,
        "tokens_per_s": statistics.median(m.tokens_per_s for m in steady),
        "train_s": sum(m.step_s for m in this_start),
        **({"compile_s": sum(m.compile_s for m in this_start)} if cfg.train.compile else {}),
        **({"compile": result.extra["compile"]} if "compile" in result.extra else {}),
        "run_dir": str(run_dir),
        "model_state_bytes_rank0": result.extra.get("model_state_bytes"),
        **({"async": result.extra["async"]} if "async" in result.extra else {}),
    }


def run_worker(cfg: RunConfig, env: WorkerEnv, run_dir_prepared: bool) -> dict[str, Any] | None:
    """Train on this rank. Rank 0 writes the run directory and returns the summary."""
    torch.set_num_threads(max(1, (torch.get_num_threads() or 1) // env.local_world_size))
    init_process_group(cfg, env)
    p = cfg.parallel
    options = CommOptions(timeout_s=p.comm_timeout_s, algo=p.comm_algo, order=p.comm_order)
    mesh = Mesh.build(
        dp=p.dp,
        pp=p.pp,
        tp=p.tp,
        cp=p.cp,
        ep=p.ep,
        options=options,
        device=rank_device(cfg, env),
        replicas=p.replicas,
    )
    preemption = Preemption(mesh.control)
    try:
        summary = _train_and_record(cfg, mesh, run_dir_prepared, env.restart_count, preemption)
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        # Signalled, then a collective failed: a second signal ended a peer at once. A
        # user's error (a full disk at the stop's checkpoint) is still reported.
        reported = (ValueError, OSError, KeyboardInterrupt, SystemExit)
        if preemption.requested_by and not isinstance(e, reported):
            raise StoppedAtOnce(preemption.requested_by) from e
        raise
    finally:
        preemption.close()
        mesh.close()
    # Only on success: after a failed collective gloo may still hold the pending work, and
    # destroy_process_group would wait for it instead of letting the process exit.
    dist.destroy_process_group()
    return summary


def resume_point(
    cfg: RunConfig, mesh: Mesh, run_dir: Path, restart_count: int
) -> checkpoint.Checkpoint | None:
    """Where to start: --resume's or a restarted job's latest complete checkpoint, or None.

    Rank 0 looks and tells everyone, so every rank starts from the same step.
    """
    answer: checkpoint.Checkpoint | ValueError | None = None
    if mesh.global_rank == 0 and (cfg.train.resume or restart_count > 0):
        try:
            answer = checkpoint.find_resumable(run_dir, cfg)
        except ValueError as e:
            answer = e
        if answer is None and cfg.train.resume:
            answer = ValueError(f"--resume {run_dir}: no complete checkpoint to resume from")
        if restart_count:
            found = answer if isinstance(answer, checkpoint.Checkpoint) else None
            where = f"step {found.step}" if found else "the start"
            log.warning("restart %d: resuming from %s", restart_count, where)
        if not isinstance(answer, ValueError):  # each step is logged exactly once
            rd.truncate_metrics(run_dir, answer.step if answer else 0)
    answer = comm.broadcast_object(answer, mesh.control)
    if isinstance(answer, ValueError):
        raise answer
    return answer


def _train_and_record(
    cfg: RunConfig,
    mesh: Mesh,
    run_dir_prepared: bool,
    restart_count: int = 0,
    stop: Preemption | None = None,
) -> dict[str, Any] | None:
    run_dir = _share_run_dir(cfg, mesh, run_dir_prepared)
    data = load_tokens(cfg.data.path, cfg.data.val_fraction, cfg.data.tokenizer)
    if data.vocab_size > cfg.model.vocab_size:
        raise ValueError(
            f"the data has token ids up to {data.vocab_size - 1} but model.vocab_size = "
            f"{cfg.model.vocab_size}; use --vocab-size {data.vocab_size} or more"
        )
    is_writer = mesh.global_rank == 0
    if is_writer:
        _record_start(cfg, mesh, run_dir, data, run_dir_prepared)
    resume = resume_point(cfg, mesh, run_dir, restart_count)  # may cut metrics.jsonl
    writer = rd.MetricsWriter(run_dir) if is_writer else None
    board = TensorBoardWriter(run_dir) if is_writer and cfg.train.tensorboard else None
    tracker = PredictionTracker(cfg, mesh)  # rank 0 logs the planner's prediction for this layout
    done = resume.step if resume is not None else 0
    progress = Progress(cfg.train.steps, cfg.train.log_every, is_writer, first_step=done)

    def on_step(m: Any) -> None:
        tracker.step_done(m.step)  # first: the step's traffic ends here
        if writer is not None:
            writer.write(m)
        if board is not None:
            board.write(m)
        progress.update(m)

    try:
        if cfg.parallel.dp_mode == "async":
            signalled = stop.signalled if stop is not None else None  # no collective
            result = train_async(cfg, mesh, data, on_step, run_dir, resume, signalled)
        else:
            result = train(cfg, mesh, data, on_step, run_dir=run_dir, resume=resume, stop=stop)
        if board is not None:
            board.validation(result.val_loss)
    finally:
        tracker.close()
        progress.close()
        if writer is not None:
            writer.close()
        if board is not None:
            board.close()
    return _summarise(cfg, mesh, run_dir, result, tracker, stop)


def _record_start(
    cfg: RunConfig, mesh: Mesh, run_dir: Path, data: TokenData, run_dir_prepared: bool
) -> None:
    """Rank 0, before the first step: the configuration, this start's provenance, the
    tokenizer, and the lines that say what the run is."""
    cfg.train.out = str(run_dir)
    rd.write_config(run_dir, cfg)
    layout = checkpoint.layout_of(cfg, mesh) | {"device": cfg.parallel.device}
    write_provenance(run_dir, data, layout, recorded=run_dir_prepared)
    keep_tokenizer(cfg, run_dir)  # sample and eval decode with it
    log.info("data: %s", data.description)
    if cfg.parallel.comm_algo != "native":
        log.info("%s", algorithms_line(cfg.parallel.comm_algo))
    log.info("run directory: %s", run_dir)
    note = warmup_note(cfg)
    if note is not None:
        log.info("%s", note)


def _summarise(
    cfg: RunConfig,
    mesh: Mesh,
    run_dir: Path,
    result: Any,
    tracker: PredictionTracker,
    stop: Preemption | None,
) -> dict[str, Any] | None:
    """After the last step (collective): every rank's measurement against the prediction;
    rank 0 writes the summary and closes this start's provenance."""
    compared = tracker.compare(result.extra.get("model_state_bytes"))
    traced = record_trace(cfg, mesh, result.engine, run_dir)  # collective (--trace)
    memory = cuda_memory(mesh)  # collective over the control group
    if mesh.global_rank != 0:
        return None
    rd.write_loss_plot(run_dir, rd.read_step_metrics(run_dir), result.val_loss)
    summary = run_summary(result, cfg, run_dir) | compared | traced | memory
    if "stopped_at_step" in summary:  # which signal; None: it reached another rank only
        summary["stopped_by"] = stop.requested_by if stop is not None else None
    summary["params"] = count_params(cfg)
    measured = compared.get("measured", {}).get("model_state_bytes")
    summary["model_state_bytes_per_rank"] = [r["total"] for r in measured] if measured else None
    rd.write_summary(run_dir, summary)
    last = result.metrics[-1].step if result.metrics else 0  # 0: no step ran in this start
    end_start(run_dir, result.extra.get("first_step", 1), last)
    return summary
