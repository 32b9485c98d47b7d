"""simulate/memory.py's meter on hand-made steps whose bytes are known, on real and fake
tensors alike: a storage counts once (views are free), from the op that makes it until
it dies; a resize in place moves the count; the step's peak splits into what was held
across the step, kept to its end, saved for backward, and the rest.

The simulation's whole-run counterpart: tests/test_simulate.py holds a simulated rank's
peak equal to a real gloo run's (leaving out the meter's resize tracking fails the ZeRO-3
case there: tried once)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from paratrain.comm.compat import FakeTensorMode
from paratrain.simulate.memory import LiveStorages

F32 = 4


def tensors(kind: str):
    return FakeTensorMode() if kind == "fake" else contextlib.nullcontext()


@pytest.mark.parametrize("kind", ["real", "fake"])
def test_a_storage_counts_once_from_its_op_until_it_dies(kind):
    with tensors(kind), LiveStorages() as m:
        a = torch.zeros(1000)
        views = [a[:10], a.view(10, 100), a.t() if a.dim() == 2 else a[::2]]
        assert m.total == 1000 * F32
        b = a * 2  # a new storage
        assert m.total == 2000 * F32
        del a, views  # b still lives; a's storage dies with its last view
        assert m.total == 1000 * F32
        del b
        assert m.total == 0
    assert m.peak == 2000 * F32


@pytest.mark.parametrize("kind", ["real", "fake"])
def test_a_resize_in_place_moves_the_count(kind):
    with tensors(kind), LiveStorages() as m:
        full = torch.empty(256)
        full.untyped_storage().resize_(0)  # as ZeRO-3 frees a unit
        assert m.total == 0
        full.untyped_storage().resize_(256 * F32)  # and gathers it again
        assert m.total == 256 * F32
    full.untyped_storage().resize_(0)  # after the meter: no longer tracked, nothing raised


@pytest.mark.parametrize("kind", ["real", "fake"])
def test_the_step_peak_splits_into_held_kept_saved_and_the_rest(kind):
    with tensors(kind), LiveStorages() as m:
        w = torch.ones(64, 64, requires_grad=True)  # held: alive before and after the step
        m.mark()
        x = torch.ones(32, 64)  # input, a temporary
        h = x @ w  # (32, 64): saved by tanh for backward
        y = torch.tanh(h)  # saved by tanh (its output) for backward
        loss = y.sum()
        loss.backward()  # w.grad: made in the step, kept to its end
        del x, h, y, loss
        m.mark()
    # The peak comes as the matmul's backward makes w's gradient, the graph still whole:
    assert m.steps[-1] == {
        "held": 64 * 64 * F32,  # w
        "kept": 64 * 64 * F32,  # w.grad, alive at the peak and at the end
        "activations": 2 * 32 * 64 * F32,  # x (the matmul's) and y (tanh's)
        "temporaries": 32 * 64 * F32 + 2 * F32,  # h's gradient; the loss and its gradient
        "peak": 57_352,  # h itself died with its name: tanh keeps its output, not its input
    }
