"""`paratrain simulate`: chosen ranks of a cluster run, each built and trained as `paratrain
train` would on that rank, on fake tensors over a fake process group, beside the
planner's prediction for the same rank (the work is in simulate/)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from paratrain.commands.config_flags import add_config_flags, config_from_args, explicit_fields

HELP = "simulate chosen ranks of a cluster run on fake tensors, against the planner"

# Flags of `train` that mean nothing without real data, files or processes: refused, not
# ignored. The value says why.
REFUSED = {
    "parallel.nproc": "the simulated world is --world",
    "parallel.backend": "the simulation's backend is torch's fake one",
    "parallel.max_restarts": "no process is restarted",
    "parallel.straggler": "no time is simulated",
    "train.out": "no run directory is written",
    "train.resume": "no checkpoint is read",
    "train.init_from": "no weights are read",
    "train.checkpoint_every": "no checkpoint is written",
    "train.keep_checkpoints": "no checkpoint is written",
    "train.tensorboard": "no run directory is written",
    "train.trace": "no time is simulated",
    "train.compile": "compilation is not simulated",
    "train.log_every": "no progress is logged",
    "data.path": "the data are fake tokens of the run's shapes",
    "data.tokenizer": "the data are fake tokens of the run's shapes",
    "data.val_fraction": "the data are fake tokens of the run's shapes",
    "train.val_batches": "the evaluation after the last step is not simulated",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world", type=int, required=True, help="the cluster's rank count")
    parser.add_argument(
        "--ranks",
        default="0",
        help="global ranks to simulate, comma-separated, or 'roles': one of each kind",
    )
    parser.add_argument("--config", help="TOML file with [model] [parallel] [train]")
    parser.add_argument("--json", action="store_true", help="one JSON object per rank")
    add_config_flags(parser)
    parser.set_defaults(**{"train.steps": None})


def checked_config(args: argparse.Namespace) -> Any:
    """The run's configuration at --world, checked as `train --dry-run` checks it (less
    the data, which are fake); a refused flag or layout raises ValueError (one line)."""
    from paratrain.validate import check_effective, resolve_and_check

    given = explicit_fields(args)
    for key, why in REFUSED.items():
        if key in given:
            raise ValueError(f"{given[key]}: has no meaning under simulation ({why})")
    if args.world < 1:
        raise ValueError(f"--world {args.world}: give the cluster's rank count, at least 1")
    cfg = config_from_args(args)
    if cfg.parallel.dp_mode == "async":  # before its batch, which counts the server out
        raise ValueError("--dp-mode async: the parameter server is not simulated")
    if "train.steps" not in given:
        cfg.train.steps = 1  # a simulation's default: one full step
    cfg.train.checkpoint_every = 0  # none is written (its save is planned once, at the end)
    cfg.train.val_batches = 0  # nothing after the last step is measured but the save's plan
    cfg.parallel.nproc = args.world
    cfg = resolve_and_check(cfg, args.world)
    check_effective(cfg, given)
    if cfg.train.dtype == "float16":
        raise ValueError("--dtype float16: the loss scaler reads values, which fake tensors lack")
    if cfg.model.num_experts:
        raise ValueError(
            f"--num-experts {cfg.model.num_experts}: a router's token counts decide shapes, "
            "which fake tensors lack; simulate a dense model (--num-experts 0)"
        )
    return cfg


def run(args: argparse.Namespace) -> int:
    cfg = checked_config(args)
    from paratrain.simulate.compare import comparison_lines, differences, rank_predictions
    from paratrain.simulate.ranks import parse_ranks, simulate_ranks

    ranks = parse_ranks(args.ranks, cfg)  # before any process starts
    predicted = rank_predictions(cfg, ranks)
    differ = []
    for measured, host in simulate_ranks(cfg, ranks):
        mine = predicted[measured["rank"]]
        differ += [f"rank {measured['rank']} {what}" for what in differences(measured, mine)]
        if args.json:
            row = {"rank": measured["rank"], "measured": measured, "predicted": mine}
            print(json.dumps(row | {"host": host}), flush=True)
            continue
        print("\n".join(comparison_lines(measured, mine)), flush=True)
        print(f"  (this machine: {host['seconds']:.0f} s, "
              f"{host['max_rss_bytes'] / 2**30:.2f} GiB at most)", flush=True)  # fmt: skip
    if differ:
        print(f"paratrain simulate: the planner and the runtime disagree: {', '.join(differ)}",
              file=sys.stderr)  # fmt: skip
    return 1 if differ else 0
