"""`no_sync()` for wrappers that reduce from backward hooks: the hooks read one flag; and
the end of a backward, for work a wrapper does once per backward (ZeRO-2's flush)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from paratrain.comm import compat


class SyncSwitch:
    """Mixed into a wrapper whose gradient hooks launch reductions only while `_sync`
    is true; `no_sync()` turns that off for the micro-batches before a step's last,
    which accumulate locally (a wrapper may still reduce where it must, as ZeRO-2 with
    accumulate="shard" does per micro-batch)."""

    _sync: bool = True
    _deferring: bool = False  # inside `one_backward`
    _at_end: Callable[[], None] | None = None

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def at_backward_end(self, work: Callable[[], None]) -> None:
        """Do `work` when the running backward ends, or inside `one_backward` when it does."""
        if self._deferring:
            self._at_end = work
        else:
            compat.queue_backward_callback(work)

    @contextlib.contextmanager
    def one_backward(self) -> Iterator[None]:
        """Several autograd calls as one backward (a zero-bubble weight pass makes one per
        weight group): the end-of-backward work once, after the last. ZeRO-2 flushed after
        each call would reduce-scatter every bucket each time, most of them zeros."""
        self._deferring, self._at_end = True, None
        try:
            yield
        finally:
            work, self._deferring, self._at_end = self._at_end, False, None
            if work is not None:
                work()
