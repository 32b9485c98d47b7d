"""A worker's error, printed once: by the first rank that fails.

When one rank fails, the others fail soon after (their collectives lose a peer, or they
meet the same bad checkpoint), and each would print its own copy. The ranks race for one
counter in the rendezvous store; the winner prints its error, records it in the elastic
launcher's error file (so the launcher names this rank), and the rest stay silent.

User errors (ValueError, running out of memory) are one line and exit status 2; anything
else is an internal error: the failing rank's traceback and exit status 1.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

import torch
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from paratrain.comm.watchdog import default_store_or_none
from paratrain.train.preemption import StoppedAtOnce

USER_ERROR, INTERNAL_ERROR = 2, 1


def describe_failure(exc: BaseException, rank: int, command: str = "train") -> tuple[int, str]:
    """(exit status, what to print) for an exception that ended this rank's work."""
    if isinstance(exc, ValueError):
        return USER_ERROR, f"paratrain {command}: error (rank {rank}): {exc}"
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        first = (str(exc).strip() or type(exc).__name__).splitlines()[0]
        return USER_ERROR, (
            f"paratrain {command}: error (rank {rank}): out of memory ({first}); "
            "`paratrain train --dry-run` shows the predicted memory per rank"
        )
    trace = "".join(traceback.format_exception(exc)).rstrip()
    return INTERNAL_ERROR, f"paratrain {command}: internal error on rank {rank}:\n{trace}"


def first_to_fail(key: str) -> bool:
    """True for the first rank to ask (per `key`); True as well when there is no store to
    ask (no process group yet, or its server gone): better printed twice than never."""
    store = default_store_or_none()
    if store is None:
        return True
    try:
        return store.add(key, 1) == 1
    except Exception:  # the store's server died with its rank
        return True


def report_failure(
    exc: BaseException, rank: int, restart_count: int = 0, command: str = "train"
) -> int:
    """Print `exc` if this rank failed first; return the exit status either way."""
    status, text = describe_failure(exc, rank, command)
    if first_to_fail(f"paratrain/failed/attempt_{restart_count}"):
        print(text, file=sys.stderr, flush=True)
        try:
            ErrorHandler().record_exception(exc)  # read by the launcher: which rank spoke
        except OSError:
            pass  # no error file to write (started without the elastic launcher)
    return status


def run_then_exit(work: Callable[[], int | None], env: dict[str, Any], command: str) -> NoReturn:
    """A launched worker's whole life: `work()` (its exit status, None for 0), its error
    printed once if it fails, then exit without running C++ static destructors (gloo and
    store threads torn down in the wrong order have aborted a finished worker now and then:
    "terminate called without an active exception", which the launcher would report as a
    failure)."""
    status = 0
    try:
        status = work() or 0
    except SystemExit:
        raise
    except StoppedAtOnce as e:  # what the user asked for: nothing to print
        status = e.status
    except KeyboardInterrupt:  # Ctrl-C before training began: the launcher reports it
        status = 128 + signal.SIGINT
    except BaseException as e:  # DCP's errors derive from BaseException
        status = report_failure(e, env["rank"], env["restart_count"], command)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
