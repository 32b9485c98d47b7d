"""`paratrain bench NAME`: our implementation against its PyTorch-native peer, alternating
pairs; how each benchmark is run (its flags: bench_flags.py; the benches themselves: bench/).

Every bench prints a readable report; `--json` adds one JSON object as the last line of
stdout. A bench whose two sides disagree (losses beyond tolerance) or whose ranks fail
raises RuntimeError: one line on stderr and exit status 1. Flags out of range raise
ValueError, which the CLI turns into one line and status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from typing import Any

from paratrain.commands.bench_flags import add_arguments as add_arguments  # the registry's

HELP = "benchmarks against PyTorch-native peers"


def run(args: argparse.Namespace) -> int:
    from paratrain.commands.logging_setup import setup_logging

    setup_logging(0)
    minimum = getattr(args, "min_pairs", 0)
    if minimum and args.pairs < minimum:
        what = "quartiles" if minimum >= 4 else "a median"
        raise ValueError(f"--pairs {args.pairs}: need at least {minimum} pairs for {what}")
    if getattr(args, "compile", False):
        _check_cpp_compiler()
    from paratrain.bench.harness.machine import machine, machine_line

    bench: Callable[[argparse.Namespace], tuple[Any, int]] = RUNNERS[args.name]
    where = machine()
    logging.getLogger("paratrain.bench").info("%s", machine_line(where))
    try:
        result, status = bench(args)
    except RuntimeError as e:  # the sides disagree, or a rank failed: its error, one line
        print(f"paratrain bench {args.name}: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({**result, "machine": where}), flush=True)
    return status


def _check_cpp_compiler() -> None:
    from paratrain.parallel.compile import cpp_compilers, find_cpp_compiler

    if find_cpp_compiler(cpp_compilers()) is None:
        names = ", ".join(cpp_compilers())
        raise ValueError(f"--compile needs a C++ compiler for inductor: none of {names} on PATH")


def _config(args: argparse.Namespace) -> Any:
    """Our default configuration, with --compile for both sides."""
    from paratrain.config import RunConfig

    cfg = RunConfig()
    cfg.train.compile = args.compile
    return cfg


def _overhead(args: argparse.Namespace) -> tuple[Any, int]:
    from paratrain.bench.overhead.run import run_overhead_bench

    if args.peer == "transformers" and args.compile:  # its blocks are not ours to compile
        raise ValueError("--peer transformers with --compile: valid with --peer plain only")
    cfg = _config(args)
    if args.profile < 0:
        raise ValueError(f"--profile {args.profile}: a count of steps, 0 (none) or more")
    run = run_overhead_bench(args.steps, args.rounds, cfg, args.peer, profile_steps=args.profile)
    return run, 0


def _comm(args: argparse.Namespace) -> tuple[Any, int]:
    from paratrain.bench.comm.run import run_comm_bench
    from paratrain.bench.comm.sweep import Sweep

    sweep = Sweep.from_flags(args.ops, args.algos, args.world_sizes, args.sizes, args.repeats)
    return run_comm_bench(sweep, args.out or None)


def _dp(args: argparse.Namespace) -> tuple[Any, int]:
    from paratrain.bench.dp.run import run_dp_bench

    return run_dp_bench(args.pairs, args.bucket_mb, args.async_steps, _config(args)), 0


def _tp(args: argparse.Namespace) -> tuple[Any, int]:
    from paratrain.bench.tp.run import run_tp_bench

    return run_tp_bench(args.pairs, args.sequence_parallel, _config(args)), 0


def _overlap(args: argparse.Namespace) -> tuple[Any, int]:
    from paratrain.bench.overlap.run import run_overlap_bench

    split = lambda flag: [n.strip() for n in flag.split(",") if n.strip()]  # noqa: E731
    return run_overlap_bench(args.pairs, split(args.mechanisms), split(args.algos))


def _layouts(args: argparse.Namespace) -> tuple[Any, int]:
    from paratrain.bench.layouts.run import run_layouts_bench

    return run_layouts_bench(args.steps), 0


def _pp(args: argparse.Namespace) -> tuple[Any, int]:
    from paratrain.bench.pp.run import run_pp_bench

    default = "gpipe,1f1b,interleaved" + ("" if args.compile else ",zb-h1")
    names = [n.strip() for n in (args.schedules or default).split(",") if n.strip()]
    out = args.out or None
    return run_pp_bench(names, args.pairs, args.microbatches, out, compile=args.compile), 0


def _zero(args: argparse.Namespace) -> tuple[Any, int]:
    from paratrain.bench.zero.run import parse_stages, run_zero_bench

    stages = parse_stages(args.stages)
    return run_zero_bench(args.pairs, stages, args.out or None, args.dp, _config(args)), 0


def _cp(args: argparse.Namespace) -> tuple[Any, int]:
    from paratrain.bench.cp.run import run_cp_bench

    shape = {
        "batch": args.batch,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "seq": args.seq_len,
        "head_dim": args.head_dim,
    }
    return run_cp_bench(_names(args.methods), shape, args.pairs), 0


def _moe(args: argparse.Namespace) -> tuple[Any, int]:
    from paratrain.bench.moe.run import run_moe_bench, tokens_sweep

    sweep = tokens_sweep(args.tokens)
    return run_moe_bench(sweep, args.d_model, args.experts, args.top_k, args.pairs), 0


def _model(args: argparse.Namespace) -> tuple[Any, int]:
    from paratrain.bench.model.run import run_model_bench

    sizes = (args.seq_len, args.batch)
    return run_model_bench(_names(args.models), args.pairs, *sizes, _names(args.what)), 0


def _muon(args: argparse.Namespace) -> tuple[Any, int]:
    from paratrain.bench.muon.run import run_muon_bench

    return run_muon_bench(args.pairs, args.steps, args.every), 0


def _lora(args: argparse.Namespace) -> tuple[Any, int]:
    from paratrain.bench.lora.run import run_lora_bench

    sizes = (args.pairs, args.rank, args.steps, args.base_steps, args.every)
    return run_lora_bench(*sizes, args.lora_lr_scale), 0


def _diloco(args: argparse.Namespace) -> tuple[Any, int]:
    from paratrain.bench.diloco.run import one_link, run_diloco_bench

    links = one_link(args.link_latency, args.link_bandwidth)
    return run_diloco_bench(args.pairs, args.steps, args.sync_every, links), 0


def _slow_links(args: argparse.Namespace) -> tuple[Any, int]:
    from paratrain.bench.diloco.loss import run_slow_links_bench

    sizes = (args.groups, args.steps, args.short, args.long, args.compress_rank)
    return run_slow_links_bench(*sizes), 0


def _names(flag: str) -> list[str]:
    return [n.strip() for n in flag.split(",") if n.strip()]


RUNNERS: dict[str, Callable[[argparse.Namespace], tuple[Any, int]]] = {
    "overhead": _overhead,
    "comm": _comm,
    "dp": _dp,
    "tp": _tp,
    "overlap": _overlap,
    "layouts": _layouts,
    "pp": _pp,
    "zero": _zero,
    "cp": _cp,
    "moe": _moe,
    "model": _model,
    "muon": _muon,
    "lora": _lora,
    "diloco": _diloco,
    "slow-links": _slow_links,
}
