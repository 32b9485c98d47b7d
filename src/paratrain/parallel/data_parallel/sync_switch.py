"""`no_sync()` for wrappers that reduce from backward hooks: the hooks read one flag."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class SyncSwitch:
    """Mixed into a wrapper whose gradient hooks launch reductions only while `_sync`
    is true; `no_sync()` turns that off for the micro-batches before a step's last,
    which accumulate locally (a wrapper may still reduce where it must, as ZeRO-2 with
    accumulate="shard" does per micro-batch)."""

    _sync: bool = True

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous
