"""A save the filesystem refused (a full disk, a quota, a permission, a read-only mount):
its partial directory removed, one line naming the cause and the path.

DCP reports a rank's failed write to every rank as a CheckpointException holding each
failing rank's exception; the OSError inside is the cause the user can act on. Earlier
checkpoints are never touched (pruning follows only a complete save).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException


class CheckpointNotSaved(ValueError):
    """Reported like a user error: one line, exit status 2, no traceback."""


def os_error_in(exc: BaseException | None) -> OSError | None:
    """The OSError that caused `exc`: itself, one in a CheckpointException, or a cause."""
    seen = 0
    while exc is not None and seen < 20:  # a bounded walk down the chain
        if isinstance(exc, OSError):
            return exc
        if isinstance(exc, CheckpointException):
            for failure, _ in exc.failures.values():
                found = os_error_in(failure)
                if found is not None:
                    return found
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


@contextmanager
def saving(path: Path, step: int, remover: bool) -> Iterator[None]:
    """Around a save into `path`; on a refused write the rank that is `remover` removes the
    partial directory (every rank has stopped writing: DCP reports failures after its
    writes) and every rank raises CheckpointNotSaved."""
    try:
        yield
    except BaseException as e:
        cause = os_error_in(e)
        if cause is None:
            raise
        if remover:
            shutil.rmtree(path, ignore_errors=True)
        where = cause.filename or path
        raise CheckpointNotSaved(
            f"checkpoint of step {step} not saved: {cause.strerror or cause} ({where}); "
            "its partial files were removed; earlier checkpoints and metrics.jsonl are kept"
        ) from None
