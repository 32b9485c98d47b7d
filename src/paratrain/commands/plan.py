"""`paratrain plan`: predict memory, communication, bubbles and step time for every layout
(plan/command.py), and with --validate run the planner's cases and compare (bench/)."""

from __future__ import annotations

import argparse

HELP = "predict memory, communication, bubbles and step time"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from paratrain.plan.arguments import add_plan_arguments

    add_plan_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from paratrain.bench.command import plan_validation
    from paratrain.commands.logging_setup import setup_logging
    from paratrain.plan.command import run_plan

    setup_logging(0)
    return run_plan(args, validate=plan_validation(args))
