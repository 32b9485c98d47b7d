"""`paratrain train | plan | bench`. With launch.py, the only reader of environment variables.

User errors (bad flags, impossible combinations) print one line and exit with status 2,
before any worker starts.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any, NoReturn

from paratrain.config import SECTIONS, RunConfig
from paratrain.config_toml import apply_overrides, field_types, load_toml
from paratrain.models.presets import preset
from paratrain.train.run_tools import RUN_TOOLS, add_run_tool_parsers, run_tool
from paratrain.validate import check_effective, resolve

log = logging.getLogger("paratrain")

# Flags whose name is not simply --<field-name-with-dashes>.
FLAG_NAMES = {("data", "path"): "--data", ("model", "name"): "--model"}


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
    train.add_argument(
        "--dry-run",
        action="store_true",
        help="run every check, print the configuration, mesh, data and plan; start nothing",
    )
    train.add_argument("--launched-worker", action="store_true", help=argparse.SUPPRESS)
    add_config_flags(train)
    plan = sub.add_parser("plan", help="predict memory, communication, bubbles and step time")
    from paratrain.plan.command import add_plan_arguments

    add_plan_arguments(plan)
    from paratrain.bench.command import add_bench_arguments

    add_bench_arguments(sub.add_parser("bench", help="benchmarks against PyTorch-native peers"))
    from paratrain.commands.schedule import add_schedule_arguments

    add_schedule_arguments(sub.add_parser("schedule", help="simulate a pipeline schedule"))
    add_run_tool_parsers(sub)
    return parser


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
    from_file = load_toml(args.config) if args.config else {}
    overrides: dict[str, dict[str, Any]] = {}
    for key, value in vars(args).items():
        if "." in key and value is not None:
            section, name = key.split(".", 1)
            overrides.setdefault(section, {})[name] = value
    # The model preset first: its shape is the default that the file and the flags change;
    # with --init-from, the source run's model is.
    name = overrides.get("model", {}).get("name") or from_file.get("model", {}).get("name")
    if name and not resume:
        apply_overrides(cfg, {"model": {**preset(name), "name": name}}, f"model preset {name}")
    source = overrides.get("train", {}).get("init_from") or from_file.get("train", {}).get(
        "init_from"
    )
    if source and not resume:
        base = Path(source) / "config.toml"
        if not base.is_file():
            raise ValueError(f"--init-from {source!r}: no {base}; give a paratrain run directory")
        model = load_toml(str(base)).get("model", {})
        apply_overrides(cfg, {"model": model}, f"--init-from {source}")
    if args.config:
        apply_overrides(cfg, from_file, f"config file {args.config}")
    apply_overrides(cfg, overrides, "command line")
    if "vocab_size" not in {**from_file.get("model", {}), **overrides.get("model", {})}:
        _vocabulary_for_the_data(cfg)
    return cfg


def explicit_fields(args: argparse.Namespace) -> dict[str, str]:
    """'section.name' -> how the user gave it: a flag, or a key of --config's file (a
    resumed run's own config.toml is not the user's choice now, so it is not listed)."""
    given: dict[str, str] = {}
    if args.config:
        for section, entries in load_toml(args.config).items():
            for name in entries if isinstance(entries, dict) else ():
                given[f"{section}.{name}"] = f"in {args.config}"
    for key, value in vars(args).items():
        if "." in key and value is not None:
            given[key] = flag_for(*key.split(".", 1))
    return given


def _vocabulary_for_the_data(cfg: RunConfig) -> None:
    """With a tokenizer (--tokenizer or a prepared directory's), a vocabulary that covers it,
    padded for tensor parallelism, unless one was given (then checked against the data)."""
    from paratrain.data.checks import tokenizer_vocab
    from paratrain.data.tokenizer import padded_vocab

    vocab = tokenizer_vocab(cfg)
    if vocab is not None and cfg.model.vocab_size < vocab:
        cfg.model.vocab_size = padded_vocab(vocab)


def setup_logging(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(message)s" if rank == 0 else f"[rank {rank}] %(levelname)s %(message)s",
        stream=sys.stderr,
    )


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.2f}"


def print_summary(summary: dict[str, Any], as_json: bool) -> None:
    print(
        f"trained {summary['steps']} steps on {summary['world_size']} processes: "
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


def cmd_train(args: argparse.Namespace) -> int:
    from paratrain.launch import torchrun_env
    from paratrain.train.worker import WorkerEnv, run_worker

    env = torchrun_env()
    setup_logging(env["rank"] if env else 0)
    cfg = config_from_args(args)
    world = env["world_size"] if env else cfg.parallel.nproc
    resolve(cfg, world, env["local_world_size"] if env else None)
    if not args.launched_worker:  # our launcher's workers read the config it wrote
        check_effective(cfg, explicit_fields(args))
    if cfg.train.resume and env is None:  # before any worker starts: is there one, is it whole
        from paratrain.train.checkpoint import find_resumable

        if find_resumable(Path(cfg.train.resume), cfg) is None:
            raise ValueError(
                f"--resume {cfg.train.resume!r}: no complete checkpoint in its checkpoints/"
            )
    data = ""
    if env is None:  # the data, whole and sufficient, before any worker starts
        from paratrain.data.checks import check_data

        data = check_data(cfg)
    if cfg.train.init_from and env is None:  # the source's weights fit this model
        from paratrain.train.checkpoint_model import check_init_source

        check_init_source(cfg.train.init_from, cfg.model)
    elif cfg.train.init_from and not args.launched_worker and env["rank"] == 0:  # torchrun's
        from paratrain.train.checkpoint import latest_checkpoint
        from paratrain.train.checkpoint_model import note_absent_buffers

        source = latest_checkpoint(Path(cfg.train.init_from))
        if source is not None:  # else build_model says there is none
            note_absent_buffers(source.path, cfg.model)
    if args.dry_run:
        from paratrain.train.dry_run import dry_run_lines

        if env is not None:
            raise ValueError("--dry-run starts no worker: run it without torchrun")
        print("\n".join(dry_run_lines(cfg, data)), flush=True)
        return 0
    if env is not None:  # a worker: of our launcher, or of a user's torchrun
        from paratrain.train.failure import run_then_exit

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


def cmd_bench(args: argparse.Namespace) -> int:
    from paratrain.bench.command import run_bench

    setup_logging(0)
    return run_bench(args)


def cmd_schedule(args: argparse.Namespace) -> int:
    from paratrain.commands.schedule import run_schedule

    return run_schedule(args)


def cmd_plan(args: argparse.Namespace) -> int:
    from paratrain.bench.command import plan_validation
    from paratrain.plan.command import run_plan

    setup_logging(0)
    return run_plan(args, validate=plan_validation(args))


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
        if args.command == "eval":  # launches workers, as train does
            from paratrain.eval_command import eval_command

            return eval_command(args)
        if args.command in RUN_TOOLS:
            return run_tool(args)
        raise ValueError(
            f"unknown command {args.command!r}; valid: train, plan, bench, schedule, export, "
            "import-hf, sample, eval, tokenizer, prepare"
        )
    except ValueError as e:
        print(f"paratrain {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("paratrain: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
