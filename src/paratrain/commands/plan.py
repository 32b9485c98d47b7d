"""`paratrain plan`: predict memory, communication, bubbles and step time for every layout
(commands/plan_run.py; flags: plan_flags.py), and with --validate run the planner's cases
and compare (bench/planner/)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

HELP = "predict memory, communication, bubbles and step time"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from paratrain.commands.plan_flags import add_plan_arguments

    add_plan_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from paratrain.commands.logging_setup import setup_logging
    from paratrain.commands.plan_run import run_plan

    setup_logging(0)
    return run_plan(args, validate=plan_validation(args))


def plan_validation(args: argparse.Namespace) -> Callable[[], int] | None:
    """`paratrain plan --validate`'s measured runs (bench/planner/), ready to run after the
    plan's table; None without --validate. Case names are checked now, before any work."""
    if not args.validate:
        return None
    from paratrain.bench.planner.run import run_validation, select_cases

    cases = args.validate_cases.split(",") if args.validate_cases else None
    select_cases(cases)  # a bad name fails here, in one line
    return lambda: run_validation(cases=cases)
