"""The streams of NCCL's order on gloo: a queue per stream, served by one thread that
issues each call and waits for it before taking the next (ordering.py says which calls go
on which stream, and why). A call runs on the stream's thread without autograd: the
caller's grad mode is thread-local, and an in-place write into a view made under no_grad
is refused with grad mode on.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch

from paratrain.comm.traffic import Traffic


class StreamBlocked(RuntimeError):
    """A call that did not complete in time under NCCL's order; `detail` shows its stream."""

    def __init__(self, cause: str, detail: str) -> None:
        super().__init__(cause)
        self.detail = detail


class StreamWork:
    """One call on a `Stream`, waited on like a backend's `dist.Work`."""

    def __init__(self, stream: Stream, label: str, blocked_on: str) -> None:
        self.stream, self.label, self.blocked_on = stream, label, blocked_on
        self.started: float | None = None  # when the stream's thread took it
        self.traffic: Traffic | None = None  # what one of our algorithms sent (call.py)
        self._done = threading.Event()
        self._error: BaseException | None = None

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: timedelta | None = None) -> bool:
        seconds = None if timeout is None else timeout.total_seconds()
        if not self._done.wait(seconds):
            raise StreamBlocked(
                f"timed out after {seconds:g} s under NCCL's order: {self.label} did not "
                f"complete on stream {self.stream.name!r}",
                self.stream.report(self),
            )
        if self._error is not None:
            raise self._error
        return True

    def execute(self, run: Callable[[], Traffic | None]) -> None:
        """Run the call here (the stream's thread) and record how it ended."""
        self.started = time.perf_counter()
        try:
            with torch.no_grad():  # see the module docstring
                self.traffic = run()
        except BaseException as e:  # handed to the waiter, who raises it
            self._error = e
        self._done.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._done.set()


class Stream:
    """Calls in issue order, one at a time, each run to completion by one daemon thread.

    After a call fails, the later ones fail at once with its error, as NCCL's communicator
    is aborted after an error.
    """

    def __init__(self, name: str, what: str) -> None:
        self.name, self.what = name, what
        self._entries: deque[tuple[StreamWork, Callable[[], Traffic | None]]] = deque()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._failed: BaseException | None = None

    def submit(self, label: str, run: Callable[[], Traffic | None], blocked_on: str) -> StreamWork:
        work = StreamWork(self, label, blocked_on)
        with self._cv:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._serve, name=f"stream-{self.name}", daemon=True
                )
                self._thread.start()
            self._entries.append((work, run))
            self._cv.notify()
        return work

    def is_current(self) -> bool:
        """Whether the caller is this stream's own thread (running one of its calls)."""
        return threading.current_thread() is self._thread

    def _serve(self) -> None:
        while True:
            with self._cv:
                while not self._entries:
                    self._cv.wait()
                work, run = self._entries[0]  # stays listed while it runs: the report shows it
            if self._failed is None:
                work.execute(run)
                self._failed = work._error
            else:
                work.fail(self._failed)
            with self._cv:
                self._entries.popleft()

    def report(self, waited: StreamWork) -> str:
        """The stream's calls in issue order, the one waited for marked, those ahead counted."""
        with self._cv:
            works = [w for w, _ in self._entries]
        now = time.perf_counter()
        lines = []
        for w in works:
            state = "queued"
            if w.started is not None:
                state = f"running for {now - w.started:.1f} s, {w.blocked_on}"
            lines.append(f"  {w.label}: {state}" + ("  <- waited for" if w is waited else ""))
        ahead = works.index(waited) if waited in works else 0
        head = (
            f"stream {self.name!r} ({self.what}): {ahead} call(s) queued ahead of "
            f"{waited.label}" + (":" if lines else "")
        )
        return "\n".join([head, *lines])


class Streams:
    """One group's streams: its collectives' (with batched send/recv), and one per pair."""

    def __init__(self, group_name: str, rank: int, ranks: Sequence[int]) -> None:
        self._group, self._rank, self._ranks = group_name, rank, list(ranks)
        self.collective = Stream("", "")
        self._name_collective()
        self._pairs: dict[int, Stream] = {}
        self._lock = threading.Lock()

    def _name_collective(self) -> None:
        self.collective.name = f"collectives of {self._group}"
        self.collective.what = (
            f"group {self._group!r} {self._ranks}: its collectives and batched send/recv, "
            "one at a time in issue order"
        )

    def also_serve(self, group_name: str) -> None:
        """Another group over the same process group shares these streams: named with it."""
        self._group += f"/{group_name}"
        self._name_collective()

    def pair(self, peer: int) -> Stream:
        """The stream of unbatched send/recv between this rank and group rank `peer`."""
        with self._lock:
            if peer not in self._pairs:
                low, high = sorted((self._rank, peer))
                self._pairs[peer] = Stream(
                    f"pair {low}:{high} of {self._group}",
                    f"unbatched send/recv between ranks {self._ranks[low]} and "
                    f"{self._ranks[high]}, one at a time in issue order",
                )
            return self._pairs[peer]
