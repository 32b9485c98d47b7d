"""Peak bytes the allocator held during a region, above what it held at the start.

Memory as the allocator saw it, not as the code counts it. On CUDA: the caching allocator's
statistics (`torch.cuda.memory_allocated`, `max_memory_allocated`). On CPU: torch.profiler's
memory events (`profile_memory=True`), one per allocation and free of a tensor storage,
each with its address, its bytes, its time and the allocator's total at that moment:

- the level over time is that total, minus the total at the start. c10 keeps it for every
  thread once its `caffe2_report_cpu_memory_usage` flag is on (set here for the region), so
  a buffer that gloo's worker thread frees is taken off at the next event; without the flag
  the level would only come from the events, and the profiler records them on the threads
  it follows (the caller's, and gloo's while it runs a collective), not on all;
- the blocks (each allocation, until its free) say what was alive at the peak
  (`live_at_peak`), and in which ranges of code each was allocated: `peak(scope=...)` is
  the peak of what was allocated inside a `record_function` range or an op of that name
  (the runtime's "fsdp.gather" range: the gathered parameters FSDP really holds), and
  `peak(where=...)` that of the blocks a filter keeps: a level from the events alone, exact
  for blocks that the threads the profiler follows free (not gloo's copies, which its worker
  thread frees when it gets to it, tens of ms after `wait()` on a busy machine);
- `phase(name)` marks a stretch of time, `peak(during=name)` is the peak inside it.

Not counted: Python objects (not tensor storage). A block allocated before the region and
freed inside it is not taken off (the allocator does not know its size then), so the level
can only overstate. The level is sampled at events: a buffer that another thread allocates
and frees between two of them is missed.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from paratrain.comm import compat


@dataclass(frozen=True)
class Allocation:
    """One allocation made inside the region: its bytes, when, and the names of the ranges
    and ops it was allocated in."""

    ptr: int
    nbytes: int
    start_ns: int
    end_ns: int | None  # None: no free seen before the region ended
    scopes: frozenset[str]


# Which blocks a level counts (None: all). Only the blocks: a level with a filter is built
# from the allocations and frees the profiler saw, not from the allocator's total.
AllocationFilter = Callable[[Allocation], bool] | None


class AllocatorMeter:
    """`with AllocatorMeter(device) as m: ...`, then `m.peak()`, `m.held()` (bytes).

    On CUDA only `peak()`, `peak(during=...)` and `held()` are available (counters)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.blocks: list[Allocation] = []
        self.ranges: dict[str, list[tuple[int, int]]] = {}  # name -> [(start_ns, end_ns)]
        self.all_threads = False  # whether the level counts frees on every thread
        self._times: list[int] = []  # the level's samples: times and bytes above the start
        self._levels: list[int] = []
        self._prof: Any = None
        self._flag_was: bool | None = None
        self._base = 0  # CUDA: bytes allocated at the start
        self._cuda_peak = 0
        self._cuda_end = 0
        self._cuda_phases: dict[str, int] = {}

    @property
    def _cuda(self) -> bool:
        return self.device.type == "cuda"

    def __enter__(self) -> AllocatorMeter:
        if self._cuda:
            torch.cuda.synchronize(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return self
        self._flag_was = _set_report_flag(True)
        self.all_threads = self._flag_was is not None
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        torch.empty(1)  # an event at the start: the allocator's total then
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._cuda:
            self._fold_cuda_peak()
            self._cuda_end = torch.cuda.memory_allocated(self.device) - self._base
            return
        torch.empty(1)  # an event at the end: frees on other threads are in its total
        self._prof.__exit__(*exc)
        if self._flag_was is not None:
            _set_report_flag(self._flag_was)
        if exc[0] is None:
            self._read(self._prof.profiler.kineto_results.experimental_event_tree())
        self._prof = None

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Mark a stretch of time, for `peak(during=name)`."""
        if not self._cuda:
            with record_function(name):
                yield
            return
        self._fold_cuda_peak()
        yield
        self._cuda_phases[name] = max(self._cuda_phases.get(name, 0), self._fold_cuda_peak())

    def _fold_cuda_peak(self) -> int:
        """The peak since the last reset (above the start), folded into the region's."""
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - self._base
        self._cuda_peak = max(self._cuda_peak, peak)
        torch.cuda.reset_peak_memory_stats(self.device)
        return peak

    def _read(self, roots: list[Any]) -> None:
        """The level and the blocks from the allocation events; the named ranges."""
        RecordScope, EventType = compat.profiler_event_kinds()  # noqa: N806
        events, stack = [], list(roots)
        while stack:
            e = stack.pop()
            stack.extend(e.children)
            if e.tag == EventType.Allocation and e.extra_fields.device.type == "cpu":
                events.append(e)
            elif e.tag == EventType.TorchOp and e.extra_fields.scope == RecordScope.USER_SCOPE:
                self.ranges.setdefault(e.name, []).append((e.start_time_ns, e.end_time_ns))
        for spans in self.ranges.values():
            spans.sort()
        events.sort(key=lambda e: e.start_time_ns)
        if not events:
            return
        first = events[0].extra_fields
        base, level = first.total_allocated - first.alloc_size, 0
        live: dict[int, tuple[int, int, frozenset[str]]] = {}  # ptr -> (bytes, start, scopes)
        for e in events:
            size, ptr, t = e.extra_fields.alloc_size, e.extra_fields.ptr, e.start_time_ns
            if size > 0:
                if ptr in live:  # freed unseen (on another thread), since it was reused
                    self._close(live, ptr, t)
                live[ptr] = (size, t, _scopes(e))
            elif size < 0 and ptr in live:  # else: allocated before the region
                self._close(live, ptr, t)
            level = e.extra_fields.total_allocated - base if self.all_threads else level + size
            self._times.append(t)
            self._levels.append(level)
        self.blocks += [Allocation(p, n, s, None, sc) for p, (n, s, sc) in live.items()]
        self.blocks.sort(key=lambda b: b.start_ns)

    def _close(self, live: dict[int, tuple[int, int, frozenset[str]]], ptr: int, t: int) -> None:
        nbytes, start, scopes = live.pop(ptr)
        self.blocks.append(Allocation(ptr, nbytes, start, t, scopes))

    def _timeline(self, scope: str | None, where: AllocationFilter) -> tuple[list[int], list[int]]:
        """Sample times and the level after each: the allocator's, or that of the blocks
        allocated in `scope` for which `where` holds."""
        if scope is None and where is None:
            return self._times, self._levels
        changes = []
        for b in self.blocks:
            if _kept(b, scope, where):
                changes.append((b.start_ns, b.nbytes))
                if b.end_ns is not None:
                    changes.append((b.end_ns, -b.nbytes))
        changes.sort()
        times, levels, level = [], [], 0
        for t, delta in changes:
            level += delta
            times.append(t)
            levels.append(level)
        return times, levels

    def _need_events(self, what: str) -> None:
        if self._cuda:
            raise ValueError(f"{what} needs the profiler's allocation events: CPU only")

    def peak(
        self, scope: str | None = None, during: str | None = None, where: AllocationFilter = None
    ) -> int:
        """Most bytes alive at once above the start (of blocks allocated in `scope`, and
        for which `where` holds), over the region or inside the ranges named `during`."""
        if self._cuda:
            if scope is not None or where is not None:
                self._need_events("peak(scope=..., where=...)")
            return self._cuda_peak if during is None else self._cuda_phases[during]
        return self._peak_at(scope, during, where)[0]

    def _peak_at(
        self, scope: str | None, during: str | None, where: AllocationFilter = None
    ) -> tuple[int, int, int]:
        """(peak, time of the peak, start of the window that holds it)."""
        times, levels = self._timeline(scope, where)
        if during is None:
            windows = [(times[0], times[-1])] if times else []
        elif during in self.ranges:
            windows = self.ranges[during]
        else:
            raise ValueError(f"no range named {during!r}; recorded: {sorted(self.ranges)}")
        best = (0, windows[0][0], windows[0][0]) if windows else (0, 0, 0)
        for start, end in windows:
            i = bisect.bisect_right(times, start)  # the level when the window opens
            if i:
                best = max(best, (levels[i - 1], start, start))
            for j in range(i, bisect.bisect_right(times, end)):
                best = max(best, (levels[j], times[j], start))
        return best

    def held(self, scope: str | None = None, where: AllocationFilter = None) -> int:
        """Bytes alive at the end above the start (of blocks allocated in `scope`, and for
        which `where` holds)."""
        if self._cuda:
            if scope is not None or where is not None:
                self._need_events("held(scope=..., where=...)")
            return self._cuda_end
        levels = self._timeline(scope, where)[1]
        return levels[-1] if levels else 0

    def live_at_peak(
        self,
        scope: str | None = None,
        during: str | None = None,
        fresh: bool = False,
        where: AllocationFilter = None,
    ) -> list[Allocation]:
        """The blocks alive at the moment of `peak(scope, during, where)`: what it is made of.

        fresh: only those allocated since the window holding the peak opened. A block whose
        free happened out of the profiler's sight (a collective's buffer that gloo's thread
        released) stays "alive" among the blocks, though not in the level; it is older."""
        self._need_events("live_at_peak")
        _, when, opened = self._peak_at(scope, during, where)
        return [
            b
            for b in self.blocks
            if _kept(b, scope, where)
            and (opened if fresh else b.start_ns) <= b.start_ns <= when
            and (b.end_ns is None or b.end_ns > when)
        ]


def _kept(block: Allocation, scope: str | None, where: AllocationFilter) -> bool:
    return (scope is None or scope in block.scopes) and (where is None or where(block))


def _scopes(event: Any) -> frozenset[str]:
    """Names of the ranges and ops an allocation was made in, innermost to outermost."""
    event_type = compat.profiler_event_kinds()[1]
    names, e = [], event.parent
    while e is not None:
        if e.tag == event_type.TorchOp:
            names.append(e.name)
        e = e.parent
    return frozenset(names)


def _set_report_flag(on: bool) -> bool | None:
    """Set c10's `caffe2_report_cpu_memory_usage` (the CPU allocator then keeps its total
    over every thread); the previous value, or None where libc10 does not export it."""
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
        flag = ctypes.c_bool.in_dll(lib, "FLAGS_caffe2_report_cpu_memory_usage")
    except (OSError, ValueError):
        return None
    was, flag.value = flag.value, on
    return was
