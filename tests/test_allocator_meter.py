"""The allocator meter (measure/allocator.py) on allocations whose sizes are known: the
level over time, phases, scopes, and a free made on another thread."""

from __future__ import annotations

import threading

import torch
from torch.profiler import record_function

from paratrain.measure.allocator import AllocatorMeter


def nbytes(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8)


def test_peak_held_phases_and_scopes_are_the_allocators_bytes():
    before = nbytes(1000)  # allocated before the region: not counted, even when freed
    with AllocatorMeter() as meter:
        with meter.phase("one"):
            a, b = nbytes(1024), nbytes(2048)
            del a
        with meter.phase("two"):
            with record_function("scoped"):
                c = nbytes(4096)
            del c, before
    assert meter.peak() == 2048 + 4096
    assert meter.peak(during="one") == 1024 + 2048
    assert meter.peak(during="two") == 2048 + 4096  # b was still held
    assert meter.held() == 2048
    assert (meter.peak(scope="scoped"), meter.held(scope="scoped")) == (4096, 0)
    unscoped = lambda block: "scoped" not in block.scopes  # noqa: E731
    assert (meter.peak(where=unscoped), meter.held(where=unscoped)) == (1024 + 2048, 2048)
    assert meter.peak(during="two", where=unscoped) == 2048
    assert sorted(x.nbytes for x in meter.live_at_peak()) == [2048, 4096]
    del b


def test_a_free_on_another_thread_lowers_the_level():
    """What gloo's worker thread does to a collective's buffers: the profiler sees no
    event for that free, but the allocator's total (kept for every thread) drops."""
    held = [nbytes(0)]
    with AllocatorMeter() as meter:
        held[0] = nbytes(8192)
        worker = threading.Thread(target=held.clear)
        worker.start()
        worker.join()
    assert meter.all_threads  # libc10 exports the flag the meter sets
    assert (meter.peak(), meter.held()) == (8192, 0)
