"""`paratrain train`: check everything, then launch the workers (or be one of them, under
torchrun), and report: the summary line, or why the run stopped and how to go on."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from paratrain.commands.config_flags import add_config_flags, config_from_args, explicit_fields
from paratrain.commands.logging_setup import setup_logging
from paratrain.fault_tolerance.group_env import group_env

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

    env = torchrun_env()
    setup_logging(env["rank"] if env else 0)
    try:
        cfg, data = _checked(args, env)
    except ValueError:
        # Under a user's torchrun every rank runs the same checks: one line per node.
        if env is not None and not args.launched_worker and env["local_rank"] != 0:
            return 2
        raise
    if args.dry_run:
        from paratrain.train.dry_run import dry_run_lines

        print("\n".join(dry_run_lines(cfg, data)), flush=True)
        return 0
    if env is not None:  # a worker: of our launcher, or of a user's torchrun
        from paratrain.train.failure import run_then_exit

        run_then_exit(lambda: _work(cfg, env, args.launched_worker, args.json), env, "train")
    from paratrain.commands.train_launch import launch_and_report

    return launch_and_report(cfg, args.json)


def _checked(args: argparse.Namespace, env: dict[str, Any] | None) -> tuple[RunConfig, str]:
    """The configuration resolved and checked, and the data in words: every refusal before
    any worker starts (under a user's torchrun, before this rank trains)."""
    from paratrain.validate import resolve_and_check
    from paratrain.validate.rules_fault_tolerance import check_torchrun_group

    cfg = config_from_args(args)
    world = env["world_size"] if env else cfg.parallel.nproc
    if env is not None and group_env(cfg.parallel.ft_group) is not None:  # a group's own world
        world *= cfg.parallel.replicas
    given = None if args.launched_worker else explicit_fields(args)  # ours: the config written
    data: list[str] = []

    def data_check(candidate: RunConfig) -> None:  # the same on either device: before torch
        if env is None:  # the data, whole and sufficient, before any worker starts
            from paratrain.data.checks import check_data

            data.append(check_data(candidate))

    local = env["local_world_size"] if env else None
    cfg = resolve_and_check(cfg, world, local, given, device_free=data_check)
    if args.dry_run and env is not None:
        raise ValueError("--dry-run starts no worker: run it without torchrun")
    check_torchrun_group(cfg, env is not None, group_env() is not None)
    _check_inputs(cfg, env, args.launched_worker)
    return cfg, "".join(data)


def _work(cfg: RunConfig, env: dict[str, Any], launched_worker: bool, as_json: bool) -> int:
    """A worker's run; the exit status. Under a user's torchrun rank 0 reports as the
    launcher would: the summary, or the stop's line and 128 + the signal."""
    from paratrain.train.worker import WorkerEnv, run_worker

    worker_env = WorkerEnv(use_env_rendezvous=True, **env)
    group = group_env(cfg.parallel.ft_group, cfg.parallel.coordinator)
    if group is not None:  # fault tolerance: the coordinator records the run from the groups'
        from paratrain.fault_tolerance.worker import run_group_worker

        run_group_worker(cfg, worker_env, group)
        return 0
    summary = run_worker(cfg, worker_env, run_dir_prepared=launched_worker)
    if summary is None or launched_worker:  # our launcher reports (exit 0: no failure)
        return 0
    from paratrain.commands.train_launch import print_summary, report_stopped

    if "stopped_at_step" in summary:
        return report_stopped(Path(summary["run_dir"]), None, summary.get("stopped_by"))
    print_summary(summary, as_json)
    return 0


def _check_inputs(cfg: RunConfig, env: dict[str, Any] | None, launched_worker: bool) -> None:
    """What a worker would fail on beyond the data, refused before any starts: the
    checkpoint to resume, --init-from's weights, the predicted memory (also under a user's
    torchrun, where no launcher of ours checked it)."""
    if cfg.train.resume and env is None:  # before any worker starts: is there one, is it whole
        from paratrain.checkpoint import find_resumable
        from paratrain.fault_tolerance.loop import group_config

        # under fault tolerance each group saves and loads as a run of its own
        saver = group_config(cfg) if cfg.parallel.fault_tolerance else cfg
        if find_resumable(Path(cfg.train.resume), saver) is None:
            raise ValueError(
                f"--resume {cfg.train.resume!r}: no complete checkpoint in its checkpoints/"
            )
    if cfg.train.init_from and env is None:  # the source's weights fit this model
        from paratrain.checkpoint.whole_model import check_init_source

        check_init_source(cfg.train.init_from, cfg.model)
    elif cfg.train.init_from and not launched_worker and env is not None and env["rank"] == 0:
        from paratrain.checkpoint import latest_checkpoint
        from paratrain.checkpoint.whole_model import note_absent_buffers

        source = latest_checkpoint(Path(cfg.train.init_from))
        if source is not None:  # else build_model says there is none
            note_absent_buffers(source.path, cfg.model)
    if env is None or not launched_worker:  # the predicted memory fits this machine
        from paratrain.train.fits import check_fits

        # Under a user's torchrun, each node checks its own ranks (torchrun numbers a
        # node's ranks contiguously); our launcher's workers were checked before it started.
        first = env["rank"] - env["local_rank"] if env else 0
        check_fits(cfg, range(first, first + env["local_world_size"]) if env else None)
