"""Our algorithms run on a communication thread, one per group, so that backward goes on.

A native collective progresses in the backend's own threads (gloo) or on a device stream
(NCCL): the caller issues it from a gradient hook and waits at the end of backward. Our
ring and tree are sequences of point-to-point steps driven from Python; run in the
autograd thread they would hold it for the whole call, and nothing would overlap. So each
group that uses them gets one thread that runs its calls in the order they were issued.
Every rank issues the same calls in the same order (the same-call rule), so every rank's
thread sends and receives the same messages in the same order. The autograd thread only
enqueues; torch releases the interpreter lock inside sends, waits and reductions, so the
two threads really run at once.

Sends and receives of the thread never mix with the issuing thread's collectives: gloo
matches point-to-point messages by their own tag space, apart from collectives.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from datetime import timedelta

import torch

from paratrain.comm.traffic import Traffic

POLL_S = 1.0  # how often a waiter checks that the thread is still alive


class ThreadWork:
    """One call queued on a `ProgressThread`, waited on like a backend's `dist.Work`."""

    def __init__(self, thread: threading.Thread) -> None:
        self._thread = thread
        self._done = threading.Event()
        self._error: BaseException | None = None
        self.traffic: Traffic | None = None  # what the call sent, once done

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Until the call ends; its own error (a CommError naming the step) if it failed.

        Every message step of the call is already bounded by the group's timeout, so this
        only guards against the thread itself having died.
        """
        del timeout  # bounded per step inside the call
        while not self._done.wait(POLL_S):
            if not self._thread.is_alive():
                raise RuntimeError(f"communication thread {self._thread.name} died")
        if self._error is not None:
            raise self._error
        return True

    def _finish(self, traffic: Traffic | None, error: BaseException | None) -> None:
        self.traffic, self._error = traffic, error
        self._done.set()


class ProgressThread:
    """A daemon thread that runs one group's calls of our algorithms, first in, first out.

    After a call fails, later calls fail at once with the same error instead of each
    waiting out its own timeout against peers that have already given up.
    """

    def __init__(self, name: str, device: torch.device) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[[], Traffic], ThreadWork]]
        self._queue = queue.SimpleQueue()
        self._device = device
        self._failed: BaseException | None = None
        self._pending = 0  # calls submitted and not yet finished
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"comm-{name}", daemon=True)
        self._thread.start()

    def submit(self, call: Callable[[], Traffic]) -> ThreadWork:
        work = ThreadWork(self._thread)
        with self._lock:
            self._pending += 1
        self._queue.put((call, work))
        return work

    def run_here(self, call: Callable[[], Traffic]) -> ThreadWork:
        """A call the caller will wait for at once: run in the caller's thread when nothing
        is queued (no hand-over to wake the thread for), else queued behind the others."""
        with self._lock:
            idle = self._pending == 0 and self._failed is None
        if not idle:
            return self.submit(call)
        work = ThreadWork(self._thread)
        try:
            work._finish(call(), None)
        except BaseException as e:  # later calls fail at once, as on the thread
            self._failed = e
            raise
        return work

    def _run(self) -> None:
        if self._device.type == "cuda":  # a new thread starts on device 0
            torch.cuda.set_device(self._device)
        while True:
            call, work = self._queue.get()
            if self._failed is None:
                try:
                    traffic, error = call(), None
                except BaseException as e:  # handed to the waiter, who raises it
                    traffic, error = None, e
                    self._failed = e
            else:
                traffic, error = None, self._failed
            with self._lock:
                self._pending -= 1
            work._finish(traffic, error)
