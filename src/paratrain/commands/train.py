"""`paratrain train`: check everything, then launch the workers (or be one of them, under
torchrun), and report: the summary line, or why the run stopped and how to go on."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from paratrain.commands.config_flags import add_config_flags, config_from_args, explicit_fields
from paratrain.commands.logging_setup import setup_logging
from paratrain.config import RunConfig

log = logging.getLogger("paratrain")
HELP = "train the GPT (default: 2 CPU workers, stdlib data)"


def add_arguments(train: argparse.ArgumentParser) -> None:
    train.add_argument("--config", help="TOML file with [model] [parallel] [train] [data]")
    train.add_argument("--json", action="store_true", help="print a JSON summary as last line")
    train.add_argument(
        "--dry-run",
        action="store_true",
        help="run every check, print the configuration, mesh, data and plan; start nothing",
    )
    train.add_argument("--launched-worker", action="store_true", help=argparse.SUPPRESS)
    add_config_flags(train)


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.2f}"


def _count(n: int, noun: str) -> str:
    """ "1 process", "2 processes": the plural a count needs."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}es" if noun.endswith("s") else f"{n} {noun}s"


def print_summary(summary: dict[str, Any], as_json: bool) -> None:
    steps, world = _count(summary["steps"], "step"), _count(summary["world_size"], "process")
    print(
        f"trained {steps} on {world}: "
        f"loss {summary['initial_loss']:.4f} -> {summary['final_loss']:.4f}, "
        f"validation {summary['val_loss']:.4f}, {summary['tokens_per_s']:,.0f} tokens/s; "
        f"run directory {summary['run_dir']}",
        flush=True,
    )
    peaks = summary.get("cuda_max_allocated_bytes")
    if peaks:  # on CUDA: what the allocator held at most, beside the model state counted
        state = summary.get("model_state_bytes_per_rank") or [None] * len(peaks)
        print(
            "CUDA memory per rank (max allocated / model state): "
            + ", ".join(
                f"{p / 2**30:.2f} / {_gib(s)} GiB" for p, s in zip(peaks, state, strict=True)
            ),
            flush=True,
        )
    if as_json:
        print(json.dumps(summary), flush=True)


def run(args: argparse.Namespace) -> int:
    from paratrain.launch import torchrun_env
    from paratrain.validate import check_effective, resolve

    env = torchrun_env()
    setup_logging(env["rank"] if env else 0)
    cfg = config_from_args(args)
    world = env["world_size"] if env else cfg.parallel.nproc
    resolve(cfg, world, env["local_world_size"] if env else None)
    if not args.launched_worker:  # our launcher's workers read the config it wrote
        check_effective(cfg, explicit_fields(args))
    if cfg.train.resume and env is None:  # before any worker starts: is there one, is it whole
        from paratrain.checkpoint import find_resumable

        if find_resumable(Path(cfg.train.resume), cfg) is None:
            raise ValueError(
                f"--resume {cfg.train.resume!r}: no complete checkpoint in its checkpoints/"
            )
    data = ""
    if env is None:  # the data, whole and sufficient, before any worker starts
        from paratrain.data.checks import check_data

        data = check_data(cfg)
    if cfg.train.init_from and env is None:  # the source's weights fit this model
        from paratrain.checkpoint.whole_model import check_init_source

        check_init_source(cfg.train.init_from, cfg.model)
    elif cfg.train.init_from and not args.launched_worker and env["rank"] == 0:  # torchrun's
        from paratrain.checkpoint import latest_checkpoint
        from paratrain.checkpoint.whole_model import note_absent_buffers

        source = latest_checkpoint(Path(cfg.train.init_from))
        if source is not None:  # else build_model says there is none
            note_absent_buffers(source.path, cfg.model)
    if env is None:  # the layout's predicted memory fits this machine
        from paratrain.train.fits import check_fits

        check_fits(cfg)
    if args.dry_run:
        from paratrain.train.dry_run import dry_run_lines

        if env is not None:
            raise ValueError("--dry-run starts no worker: run it without torchrun")
        print("\n".join(dry_run_lines(cfg, data)), flush=True)
        return 0
    if env is not None:  # a worker: of our launcher, or of a user's torchrun
        from paratrain.train.failure import run_then_exit
        from paratrain.train.worker import WorkerEnv, run_worker

        def work() -> None:
            worker_env = WorkerEnv(use_env_rendezvous=True, **env)
            summary = run_worker(cfg, worker_env, run_dir_prepared=args.launched_worker)
            if summary is not None and not args.launched_worker:
                print_summary(summary, args.json)

        run_then_exit(work, env, "train")
    return launch_and_report(cfg, args.json)


def launch_and_report(cfg: RunConfig, as_json: bool) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from paratrain.launch import WorkersFailed, launch_local
    from paratrain.train import run_dir as rd
    from paratrain.train.failed_start import before_start, undo_failed_start
    from paratrain.train.worker import WorkerEnv, run_worker

    fresh = not cfg.train.resume
    run_dir = rd.prepare_run_dir(cfg.train.out) if fresh else Path(cfg.train.resume)
    before = before_start(run_dir, fresh)
    if not fresh:
        rd.keep_previous_config(run_dir)
    cfg.train.out = str(run_dir)
    config_path = rd.write_config(run_dir, cfg)
    if cfg.parallel.nproc == 1:  # the same worker code, in this process
        env = WorkerEnv(0, 1, 0, 1, use_env_rendezvous=False)
        try:
            summary = run_worker(cfg, env, run_dir_prepared=True)
        except BaseException:
            undo_failed_start(before)
            raise
    else:
        try:
            launch_local(cfg.parallel.nproc, config_path, max_restarts=cfg.parallel.max_restarts)
        except WorkersFailed as e:
            log.error("paratrain: %s; %s", e, undo_failed_start(before))
            return 2 if e.exitcode == 2 else 1  # a user error stays one
        except SignalException as e:  # the launcher was told to stop; workers saved
            return report_stopped(run_dir, f"signal {e.sigval.name}")
        summary = rd.read_summary(run_dir)
    assert summary is not None
    if "stopped_at_step" in summary:
        return report_stopped(run_dir, "SIGTERM")
    print_summary(summary, as_json)
    return 0


STOPPED_EXIT = 143  # 128 + SIGTERM, what a scheduler expects from a terminated job


def report_stopped(run_dir: Path, why: str) -> int:
    from paratrain.checkpoint import latest_checkpoint

    ckpt = latest_checkpoint(run_dir)
    where = f"checkpoint of step {ckpt.step} in {ckpt.path}" if ckpt else "no checkpoint"
    print(
        f"paratrain train: stopped by {why}; {where}; continue with "
        f"`paratrain train --resume {run_dir}`",
        file=sys.stderr,
        flush=True,
    )
    return STOPPED_EXIT
