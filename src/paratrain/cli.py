"""`paratrain COMMAND ...`: the registry of commands (commands/), each with its parser and
its run. With launch.py, the only reader of environment variables.

User errors (bad flags, impossible combinations) print one line and exit with status 2,
before any worker starts.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from paratrain.commands import COMMANDS, command

DESCRIPTION = (
    "Train PyTorch models across many processes: data, tensor, pipeline, context and "
    "expert parallelism, ZeRO and FSDP, each checked against one process. "
    "`paratrain COMMAND --help` for a command's flags."
)


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="paratrain", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    for name in COMMANDS:
        module = command(name)
        module.add_arguments(sub.add_parser(name, help=module.HELP))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return command(args.command).run(args)
    except ValueError as e:
        print(f"paratrain {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("paratrain: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
