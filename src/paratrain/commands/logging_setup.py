"""Where a command's log lines go: rank 0's as plain messages, the others' only when they
warn, each marked with its rank; all on stderr, stdout being the command's result."""

from __future__ import annotations

import logging
import sys


def setup_logging(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(message)s" if rank == 0 else f"[rank {rank}] %(levelname)s %(message)s",
        stream=sys.stderr,
    )
