"""Peak memory of a rank as its tensors hold it: every storage alive, counted once.

No allocator exists under fake tensors, so the meter keeps what one would: each tensor
storage an op returns is counted from its first appearance until the storage dies (a
weak reference's callback: torch keeps one Python object per live storage), at its
size in bytes, views included once. ZeRO-3 frees and regathers a unit's parameters by
resizing their storage in place (parallel/data_parallel/fsdp_units.py), which no op
shows, so the meter wraps `UntypedStorage.resize_` while it is on (as torch's own
`MemTracker` does). It works the same on real tensors, so a real run and a simulated
one of the same rank can be held against each other.

At each step's end (`mark`) the meter reports the step's peak, split by what the live
storages were at that moment:

  held         alive at the step's start and still at its end: parameters, optimizer
               state, master weights, gradient buffers kept across steps
  kept         made during the step and alive at its end: the step's gradients
  activations  saved for backward by autograd (and not held)
  temporaries  the rest: gathered parameters, logits' gradients, collectives' buffers
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from paratrain.comm.compat import TorchDispatchMode

CATEGORIES = ("held", "kept", "activations", "temporaries")


@dataclass
class _Storage:
    serial: int  # unique for the meter's life: a dead storage's id() can return
    nbytes: int
    ref: Any  # the weak reference whose callback forgets it


class LiveStorages(TorchDispatchMode):
    """Use as `with LiveStorages() as m:` around the work; `m.mark()` at each step end;
    `m.steps` holds each step's peak by category."""

    def __init__(self, ignore: tuple[torch.Tensor, ...] = ()) -> None:
        super().__init__()
        # The run's token streams: host data, read a batch at a time, not the rank's memory
        # (on a GPU they are not in its memory at all); the tensors are kept, so ids hold.
        self.ignore = {id(t.untyped_storage()) for t in ignore}
        self._ignored = ignore
        self.live: dict[int, _Storage] = {}  # id(storage) -> its record
        self.total = 0
        self.serials = itertools.count()
        self.saved: set[int] = set()  # serials saved for backward since they were made
        self.step_start: set[int] = set()  # serials alive at the last mark
        self.peak, self.rising = 0, False
        self.at_peak: dict[int, int] = {}  # serial -> bytes, the live set at the peak
        self.saved_at_peak: set[int] = set()
        self.steps: list[dict[str, int]] = []
        self._resize: Any = None
        self._hooks: Any = None

    # --- what is alive ---------------------------------------------------------------------
    def _see(self, t: torch.Tensor) -> int:
        """The serial of t's storage, counting the storage if it is new."""
        storage = t.untyped_storage()
        record = self.live.get(id(storage))
        if record is None and id(storage) in self.ignore:
            return -1
        if record is None:
            key = id(storage)
            record = _Storage(next(self.serials), storage.nbytes(), None)
            record.ref = weakref.ref(storage, self._forget(key))
            self.live[key] = record
            self._grow(record.nbytes)
        return record.serial

    def _grow(self, nbytes: int) -> None:
        self.total += nbytes
        if nbytes > 0 and self.total > self.peak:
            self.peak, self.rising = self.total, True

    def _shrink(self, nbytes: int) -> None:
        """Called before the storage shrinks or goes, so that a snapshot at the peak
        still holds all of it."""
        if nbytes > 0 and self.rising:  # the peak is behind us: keep what made it
            self._snapshot()
        self.total -= nbytes

    def _forget(self, key: int) -> Any:
        """The weak reference's callback for the storage under `key`."""
        return lambda _ref: self._gone(key)

    def _gone(self, key: int) -> None:
        record = self.live.get(key)
        if record is not None:
            self._shrink(record.nbytes)
            del self.live[key]
            self.saved.discard(record.serial)

    def _resized(self, storage: Any, nbytes: int) -> None:
        record = self.live.get(id(storage))
        if record is None:
            return
        change = nbytes - record.nbytes
        if change < 0:
            self._shrink(-change)
        record.nbytes = nbytes
        if change >= 0:
            self._grow(change)

    def _snapshot(self) -> None:
        self.at_peak = {r.serial: r.nbytes for r in self.live.values()}
        self.saved_at_peak = set(self.saved)
        self.rising = False

    # --- the step's peak -------------------------------------------------------------------
    def mark(self) -> None:
        """A step ends: record its peak by category and start the next step's."""
        if self.rising:
            self._snapshot()
        now = {r.serial for r in self.live.values()}
        split = dict.fromkeys(CATEGORIES, 0)
        for serial, nbytes in self.at_peak.items():
            if serial in self.step_start and serial in now:
                split["held"] += nbytes
            elif serial in now:
                split["kept"] += nbytes
            elif serial in self.saved_at_peak:
                split["activations"] += nbytes
            else:
                split["temporaries"] += nbytes
        self.steps.append({"peak": sum(split.values()), **split})
        self.step_start = now
        self.peak, self.rising, self.at_peak = self.total, False, {}

    # --- hooks ----------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self._see_all(out)
        return out

    def _see_all(self, out: Any) -> None:
        """An op returns a tensor, or tuples and lists of them (and of other values)."""
        if isinstance(out, torch.Tensor):
            self._see(out)
        elif isinstance(out, tuple | list):
            for item in out:
                self._see_all(item)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        serial = self._see(t)
        if serial >= 0:  # not an ignored storage
            self.saved.add(serial)
        # Detached: a saved output returned with its grad_fn would hold that grad_fn, which
        # holds it, a cycle through C++ that no collector frees once a graph is retained
        # (ZB-H1's input pass): each step's graphs stayed. Autograd reattaches it.
        return t.detach()

    def __enter__(self) -> LiveStorages:
        original = torch.UntypedStorage.resize_
        meter = self

        def resize_(storage: Any, nbytes: int) -> Any:
            out = original(storage, nbytes)
            meter._resized(storage, nbytes)
            return out

        self._resize = original
        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign,assignment]
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._hooks.__exit__(*exc)
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
