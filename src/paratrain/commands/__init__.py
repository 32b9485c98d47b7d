"""The command line's commands, one module each: `HELP` (its line in `paratrain --help`),
`add_arguments(parser)` and `run(args) -> exit status`. cli.py is their registry: it
builds one subparser per entry of COMMANDS and hands the parsed arguments to `run`.

A command module imports only argparse-level code at its top (every command's parser is
built on each start, and a refusal must answer before torch loads); the work is imported
inside `run`. Shared pieces: config_flags.py (the run configuration from flags) and
logging_setup.py. May import everything below it (every package but cli.py and launch.py).
"""

from __future__ import annotations

import importlib
from types import ModuleType

# command -> its module here, in the order `paratrain --help` lists them
COMMANDS = {
    "train": "train",
    "plan": "plan",
    "simulate": "simulate",
    "bench": "bench",
    "schedule": "schedule",
    "export": "export",
    "tokenizer": "tokenizer",
    "prepare": "prepare",
    "sample": "sample",
    "eval": "eval",
    "import-hf": "import_hf",
}


def command(name: str) -> ModuleType:
    """The module of command `name` (one of COMMANDS)."""
    return importlib.import_module(f"paratrain.commands.{COMMANDS[name]}")
