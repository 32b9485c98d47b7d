"""`paratrain train | plan | bench`. With launch.py, the only reader of environment variables.

User errors (bad flags, impossible combinations) print one line and exit with status 2,
before any worker starts.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any, NoReturn

from paratrain.config import SECTIONS, RunConfig, apply_overrides, field_types, load_toml
from paratrain.validate import resolve

log = logging.getLogger("paratrain")

# Flags whose name is not simply --<field-name-with-dashes>.
FLAG_NAMES = {("data", "path"): "--data"}


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def flag_for(section: str, name: str) -> str:
    return FLAG_NAMES.get((section, name), "--" + name.replace("_", "-"))


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(f"[{section}]")
        types = field_types(cls)
        for f in fields(cls):
            help_text = f"{f.metadata['help']} (default: {f.default!r})"
            if types[f.name] is bool:  # --flag / --no-flag
                group.add_argument(
                    flag_for(section, f.name),
                    dest=f"{section}.{f.name}",
                    default=None,
                    action=argparse.BooleanOptionalAction,
                    help=help_text,
                )
                continue
            group.add_argument(
                flag_for(section, f.name),
                dest=f"{section}.{f.name}",
                type=types[f.name],
                default=None,
                metavar=types[f.name].__name__.upper(),
                help=help_text,
            )


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="paratrain", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    train = sub.add_parser("train", help="train the GPT (default: 2 CPU workers, stdlib data)")
    train.add_argument("--config", help="TOML file with [model] [parallel] [train] [data]")
    train.add_argument("--json", action="store_true", help="print a JSON summary as last line")
    train.add_argument("--launched-worker", action="store_true", help=argparse.SUPPRESS)
    add_config_flags(train)
    plan = sub.add_parser("plan", help="predict memory, communication, bubbles and step time")
    from paratrain.plan.command import add_plan_arguments

    add_plan_arguments(plan)
    bench = sub.add_parser("bench", help="benchmarks against PyTorch-native peers")
    benches = bench.add_subparsers(dest="name", required=True, parser_class=OneLineParser)
    overhead = benches.add_parser("overhead", help="our training step against a plain loop")
    overhead.add_argument("--json", action="store_true", help="print a JSON result as last line")
    overhead.add_argument("--steps", type=int, default=20, help="timed steps per round")
    overhead.add_argument("--rounds", type=int, default=7, help="alternating rounds of each loop")
    add_bench_comm_flags(benches.add_parser("comm", help="native, ring, tree collectives"))
    dp = benches.add_parser("dp", help="DataParallel against torch DDP; overlap; sync vs async")
    dp.add_argument("--json", action="store_true", help="print a JSON result as last line")
    dp.add_argument("--pairs", type=int, default=20, help="alternating step pairs (at least 4)")
    dp.add_argument("--bucket-mb", type=float, default=25.0, help="bucket size of both wrappers")
    dp.add_argument("--async-steps", type=int, default=40, help="steps of the straggler runs")
    add_bench_tp_flags(benches.add_parser("tp", help="tensor parallel against torch DTensor"))
    layouts = benches.add_parser("layouts", help="every 8-rank layout: time, bytes, memory")
    layouts.add_argument("--json", action="store_true", help="print a JSON result as last line")
    layouts.add_argument("--steps", type=int, default=4, help="steps per layout (first: warm-up)")
    add_bench_pp_flags(benches.add_parser("pp", help="pipeline schedules against torch pipelining"))
    add_bench_zero_flags(benches.add_parser("zero", help="ZeRO 0-3 against DDP, +ZeRO, FSDP2"))
    from paratrain.measure.schedule_command import add_schedule_arguments

    add_schedule_arguments(sub.add_parser("schedule", help="simulate a pipeline schedule"))
    export = sub.add_parser("export", help="a run's checkpointed model as one safetensors file")
    export.add_argument("run_dir", help="the run directory (its checkpoints/ are read)")
    export.add_argument("--step", type=int, help="the checkpoint's step (default: the latest)")
    export.add_argument("--out", help="output file (default: RUN_DIR/model.safetensors)")
    return parser


def add_bench_pp_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print a JSON result as last line")
    parser.add_argument("--pairs", type=int, default=20, help="alternating step pairs (at least 2)")
    parser.add_argument(
        "--schedules", default="gpipe,1f1b,interleaved,zb-h1", help="ours, comma-separated"
    )
    parser.add_argument("--microbatches", type=int, default=8, help="micro-batches K per step")
    parser.add_argument("--out", default="runs/bench-pp", help="folder for Gantt PNGs ('' none)")


def add_bench_zero_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print a JSON result as last line")
    parser.add_argument("--pairs", type=int, default=20, help="alternating step pairs (at least 4)")
    parser.add_argument("--stages", default="0,1,2,3", help="ZeRO stages, comma-separated")
    parser.add_argument("--dp", type=int, default=2, help="ranks (time only at 2 on 2 cores)")
    parser.add_argument("--out", default="runs/bench-zero.png", help="PNG plot ('' for none)")


def add_bench_comm_flags(parser: argparse.ArgumentParser) -> None:
    from paratrain.bench import comm

    parser.add_argument("--ops", default=",".join(comm.OPS), help="collectives, comma-separated")
    parser.add_argument("--algos", default="native,ring,tree", help="algorithms to compare")
    parser.add_argument("--world-sizes", default="2,4,8", help="ranks per run, e.g. 2,4,8")
    parser.add_argument(
        "--sizes", default=comm.DEFAULT_SIZES_FLAG, help="message sizes, e.g. 1KB,1MB,64MB"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=10,
        help="timed samples (a third, at least 3, above 4 MB or with more ranks than cores)",
    )
    parser.add_argument("--out", default="runs/bench-comm.png", help="PNG plot ('' for none)")
    parser.add_argument("--json", action="store_true", help="print a JSON result as last line")


def add_bench_tp_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print a JSON result as last line")
    parser.add_argument("--pairs", type=int, default=20, help="alternating step pairs (at least 4)")
    parser.add_argument(
        "--sequence-parallel",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="both sides sequence parallel (ours; DTensor SequenceParallel)",
    )


def config_from_args(args: argparse.Namespace) -> RunConfig:
    cfg = RunConfig()
    resume = getattr(args, "train.resume", None)
    if resume:  # the run's own config first; the layout may change, so dp and K are redone
        base = Path(resume) / "config.toml"
        if not base.is_file():
            raise ValueError(f"--resume {resume!r}: no {base}; give a paratrain run directory")
        apply_overrides(cfg, load_toml(str(base)), f"run directory {resume}")
        cfg.parallel.dp, cfg.train.microbatches = 0, 0
        out = getattr(args, "train.out", None)
        if out and Path(out).resolve() != Path(resume).resolve():
            raise ValueError(
                f"--out {out!r} with --resume {resume!r}: a resumed run stays in its directory"
            )
        cfg.train.out = resume
    if args.config:
        apply_overrides(cfg, load_toml(args.config), f"config file {args.config}")
    overrides: dict[str, dict[str, Any]] = {}
    for key, value in vars(args).items():
        if "." in key and value is not None:
            section, name = key.split(".", 1)
            overrides.setdefault(section, {})[name] = value
    apply_overrides(cfg, overrides, "command line")
    return cfg


def torchrun_env() -> dict[str, Any] | None:
    """Rank facts when started by torchrun / elastic launch, else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    return {
        "rank": int(os.environ["RANK"]),
        "world_size": int(os.environ["WORLD_SIZE"]),
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
        "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "agent_store": (
            f"{os.environ.get('MASTER_ADDR', 'localhost')}:{os.environ.get('MASTER_PORT', '0')}"
            if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            else ""
        ),
    }


def setup_logging(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(message)s" if rank == 0 else f"[rank {rank}] %(levelname)s %(message)s",
        stream=sys.stderr,
    )


def print_summary(summary: dict[str, Any], as_json: bool) -> None:
    print(
        f"trained {summary['steps']} steps on {summary['world_size']} processes: "
        f"loss {summary['initial_loss']:.4f} -> {summary['final_loss']:.4f}, "
        f"validation {summary['val_loss']:.4f}, {summary['tokens_per_s']:,.0f} tokens/s; "
        f"run directory {summary['run_dir']}",
        flush=True,
    )
    if as_json:
        print(json.dumps(summary), flush=True)


def cmd_train(args: argparse.Namespace) -> int:
    from paratrain.train.worker import WorkerEnv, run_worker

    env = torchrun_env()
    setup_logging(env["rank"] if env else 0)
    cfg = config_from_args(args)
    world = env["world_size"] if env else cfg.parallel.nproc
    resolve(cfg, world)
    if cfg.train.resume and env is None:  # before any worker starts: is there one, is it whole
        from paratrain.train.checkpoint import find_resumable

        if find_resumable(Path(cfg.train.resume), cfg) is None:
            raise ValueError(
                f"--resume {cfg.train.resume!r}: no complete checkpoint in its checkpoints/"
            )
    if env is not None:  # a worker: of our launcher, or of a user's torchrun
        worker_env = WorkerEnv(use_env_rendezvous=True, **env)
        summary = run_worker(cfg, worker_env, run_dir_prepared=args.launched_worker)
        if summary is not None and not args.launched_worker:
            print_summary(summary, args.json)
        # Everything is written and the process group destroyed. Leave without running
        # C++ static destructors: gloo and store threads torn down in the wrong order have
        # aborted a finished worker now and then ("terminate called without an active
        # exception"), which the launcher would report as a failed run.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return launch_and_report(cfg, args.json)


def launch_and_report(cfg: RunConfig, as_json: bool) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from paratrain.launch import WorkersFailed, launch_local
    from paratrain.train import run_dir as rd
    from paratrain.train.worker import WorkerEnv, run_worker

    if cfg.train.resume:
        run_dir = Path(cfg.train.resume)
        rd.keep_previous_config(run_dir)
    else:
        run_dir = rd.prepare_run_dir(cfg.train.out)
    cfg.train.out = str(run_dir)
    config_path = rd.write_config(run_dir, cfg)
    if cfg.parallel.nproc == 1:  # the same worker code, in this process
        env = WorkerEnv(0, 1, 0, 1, use_env_rendezvous=False)
        summary = run_worker(cfg, env, run_dir_prepared=True)
    else:
        try:
            launch_local(cfg.parallel.nproc, config_path, max_restarts=cfg.parallel.max_restarts)
        except WorkersFailed as e:
            log.error("paratrain: %s; run directory %s", e, run_dir)
            return 1
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
    from paratrain.train.checkpoint import latest_checkpoint

    ckpt = latest_checkpoint(run_dir)
    where = f"checkpoint of step {ckpt.step} in {ckpt.path}" if ckpt else "no checkpoint"
    print(
        f"paratrain train: stopped by {why}; {where}; continue with "
        f"`paratrain train --resume {run_dir}`",
        file=sys.stderr,
        flush=True,
    )
    return STOPPED_EXIT


def cmd_export(args: argparse.Namespace) -> int:
    from paratrain.train.export import export_safetensors

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"{args.run_dir!r} is not a directory; give a paratrain run directory")
    out = export_safetensors(run_dir, Path(args.out) if args.out else None, args.step)
    print(f"wrote {out}", flush=True)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    setup_logging(0)
    if args.name == "comm":
        return cmd_bench_comm(args)
    if args.name == "pp":
        return cmd_bench_pp(args)
    if args.name == "layouts":
        from paratrain.bench.layouts import run_layouts_bench

        result = run_layouts_bench(args.steps)
        if args.json:
            print(json.dumps(result), flush=True)
        return 0
    if args.name == "tp":
        return cmd_bench_tp(args)
    if args.name == "zero":
        return cmd_bench_zero(args)
    if args.name == "dp":
        if args.pairs < 4:
            raise ValueError(f"--pairs {args.pairs}: need at least 4 pairs for quartiles")
        from paratrain.bench.dp import run_dp_bench

        result = run_dp_bench(args.pairs, args.bucket_mb, args.async_steps)
        if args.json:
            print(json.dumps(result), flush=True)
        return 0
    from paratrain.bench.overhead import run_overhead_bench

    result = run_overhead_bench(steps=args.steps, rounds=args.rounds)
    if args.json:
        print(json.dumps(result), flush=True)
    return 0


def cmd_bench_zero(args: argparse.Namespace) -> int:
    if args.pairs < 4:
        raise ValueError(f"--pairs {args.pairs}: need at least 4 pairs for quartiles")
    from paratrain.bench.zero import parse_stages, run_zero_bench

    stages = parse_stages(args.stages)
    try:
        result = run_zero_bench(args.pairs, stages, args.out or None, args.dp)
    except RuntimeError as e:  # the two loss curves disagree: one line
        print(f"paratrain bench zero: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result), flush=True)
    return 0


def cmd_bench_tp(args: argparse.Namespace) -> int:
    if args.pairs < 4:
        raise ValueError(f"--pairs {args.pairs}: need at least 4 pairs for quartiles")
    from paratrain.bench.tp import run_tp_bench

    try:
        result = run_tp_bench(args.pairs, args.sequence_parallel)
    except RuntimeError as e:  # the two loss curves disagree: one line
        print(f"paratrain bench tp: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result), flush=True)
    return 0


def cmd_bench_comm(args: argparse.Namespace) -> int:
    from paratrain.bench.comm import Sweep, run_comm_bench

    sweep = Sweep.from_flags(args.ops, args.algos, args.world_sizes, args.sizes, args.repeats)
    try:
        result, status = run_comm_bench(sweep, args.out or None)
    except RuntimeError as e:  # a rank failed or hung: its error, in one line
        print(f"paratrain bench comm: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result), flush=True)
    return status


def cmd_bench_pp(args: argparse.Namespace) -> int:
    from paratrain.bench.pp import run_pp_bench

    names = [n.strip() for n in args.schedules.split(",") if n.strip()]
    try:
        result = run_pp_bench(names, args.pairs, args.microbatches, args.out or None)
    except RuntimeError as e:  # the two sides' losses disagree: one line
        print(f"paratrain bench pp: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result), flush=True)
    return 0


def cmd_schedule(args: argparse.Namespace) -> int:
    from paratrain.measure.schedule_command import run_schedule

    return run_schedule(args)


def cmd_plan(args: argparse.Namespace) -> int:
    from paratrain.plan.command import run_plan

    setup_logging(0)
    return run_plan(args)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "train":
            return cmd_train(args)
        if args.command == "bench":
            return cmd_bench(args)
        if args.command == "plan":
            return cmd_plan(args)
        if args.command == "schedule":
            return cmd_schedule(args)
        if args.command == "export":
            return cmd_export(args)
        raise ValueError(
            f"unknown command {args.command!r}; valid: train, plan, bench, schedule, export"
        )
    except ValueError as e:
        print(f"paratrain {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("paratrain: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
