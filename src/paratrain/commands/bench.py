"""`paratrain bench X`: our implementation against its PyTorch-native peer, alternating
pairs (the benches: bench/, their flags and dispatch: bench/command.py)."""

from __future__ import annotations

import argparse

HELP = "benchmarks against PyTorch-native peers"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from paratrain.bench.command import add_bench_arguments

    add_bench_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from paratrain.bench.command import run_bench
    from paratrain.commands.logging_setup import setup_logging

    setup_logging(0)
    return run_bench(args)
