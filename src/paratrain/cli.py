"""`paratrain COMMAND ...`: the registry of commands (commands/), each with its parser and
its run. With launch.py, the only reader of environment variables.

User errors (bad flags, impossible combinations) print one line and exit with status 2,
before any worker starts; a misspelled flag, command or value gets the nearest valid one.
Flags are never matched by prefix (`--step 7` is not `--steps 7`). A closed pipe
(`paratrain plan | head`) ends quietly.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from typing import Any, NoReturn

from paratrain import __version__
from paratrain.commands import COMMANDS, command
from paratrain.commands.suggest import hint, unknown_flags_message

DESCRIPTION = (
    "Train PyTorch models across many processes: data, tensor, pipeline, context and\n"
    "expert parallelism, ZeRO and FSDP, each checked against one process."
)
EPILOG = (
    "examples:\n"
    "  paratrain train --steps 100 --nproc 2          train the small GPT on 2 CPU processes\n"
    "  paratrain train --nproc 4 --dp 2 --tp 2 --dry-run   check a layout without running it\n"
    "  paratrain plan --preset llama3-8b --gpus 64    the best layouts for a cluster\n"
    "`paratrain COMMAND --help` lists a command's flags."
)


class OneLineParser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)  # `--step 7` must not mean `--steps 7`
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}{hint(message)} (see --help)\n")


class WholeNames(argparse.HelpFormatter):
    """Help lines wrapped between words only: a preset's name (`seeds-80gb-nvlink300-ib50-1e14`)
    is never cut at one of its hyphens."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="paratrain",
        usage="paratrain COMMAND [flags]",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"paratrain {__version__}")
    sub = parser.add_subparsers(
        dest="command", required=True, parser_class=OneLineParser, metavar="COMMAND"
    )
    for name in COMMANDS:
        module = command(name)
        parser_ = sub.add_parser(
            name, prog=f"paratrain {name}", help=module.HELP, description=module.HELP,
            formatter_class=WholeNames,
        )  # fmt: skip
        module.add_arguments(parser_)
    return parser


def _parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """parse_args, with the nearest flag named for each unrecognized one."""
    args, extras = parser.parse_known_args(argv)
    if extras:
        innermost = _innermost(parser, args)
        innermost.error(unknown_flags_message(innermost, extras))
    return args


def _innermost(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> argparse.ArgumentParser:
    """The parser of the (sub)command the arguments chose, e.g. `tokenizer train`'s."""
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        chosen = getattr(args, subs[0].dest, None) if subs else None
        if chosen is None:
            return parser
        parser = subs[0].choices[chosen]


def _quiet_closed_pipe() -> int:
    """The reader went away (`| head`): stop writing, no traceback; 141 as a shell says."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())  # Python flushes stdout again at exit
    return 141


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
        args = _parse(parser, argv)
        try:
            return command(args.command).run(args)
        except ValueError as e:
            print(f"paratrain {args.command}: error: {e}{hint(str(e))}", file=sys.stderr)
            return 2
    except BrokenPipeError:
        return _quiet_closed_pipe()
    except KeyboardInterrupt:
        print("paratrain: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
