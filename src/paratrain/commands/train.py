"""`paratrain train`: check everything, then launch the workers (or be one of them, under
torchrun), and report: the summary line, or why the run stopped and how to go on."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from paratrain.commands.config_flags import add_config_flags, config_from_args, explicit_fields
from paratrain.commands.logging_setup import setup_logging

if TYPE_CHECKING:
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


def run(args: argparse.Namespace) -> int:
    from paratrain.launch import torchrun_env
    from paratrain.validate import check_effective, resolve_and_check

    env = torchrun_env()
    setup_logging(env["rank"] if env else 0)
    cfg = config_from_args(args)
    world = env["world_size"] if env else cfg.parallel.nproc
    cfg = resolve_and_check(cfg, world, env["local_world_size"] if env else None)
    if not args.launched_worker:  # our launcher's workers read the config it wrote
        check_effective(cfg, explicit_fields(args))
    data = _check_inputs(cfg, env, args.launched_worker)
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
            if summary is not None and not args.launched_worker:  # torchrun's rank 0
                from paratrain.commands.train_launch import print_summary, report_stopped

                if "stopped_at_step" in summary:
                    run_dir, by = Path(summary["run_dir"]), summary.get("stopped_by")
                    report_stopped(run_dir, None, by)
                else:
                    print_summary(summary, args.json)

        run_then_exit(work, env, "train")
    from paratrain.commands.train_launch import launch_and_report

    return launch_and_report(cfg, args.json)


def _check_inputs(cfg: RunConfig, env: dict[str, Any] | None, launched_worker: bool) -> str:
    """What a worker would fail on, refused before any starts: the checkpoint to resume,
    the data (returned in words), --init-from's weights, the predicted memory."""
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
    elif cfg.train.init_from and not launched_worker and env is not None and env["rank"] == 0:
        from paratrain.checkpoint import latest_checkpoint
        from paratrain.checkpoint.whole_model import note_absent_buffers

        source = latest_checkpoint(Path(cfg.train.init_from))
        if source is not None:  # else build_model says there is none
            note_absent_buffers(source.path, cfg.model)
    if env is None:  # the layout's predicted memory fits this machine
        from paratrain.train.fits import check_fits

        check_fits(cfg)
    return data
