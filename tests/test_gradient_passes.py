"""The step scales the gradients once: 1 / tokens and the clip's factor in one pass, as a
plain loop makes one (the clip's). A second pass over every gradient cost 2% of the
default model's step against a plain loop (docs/benchmarks.md, the Intel Xeon's section).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from paratrain.mesh import Mesh
from paratrain.parallel.data_parallel import DataParallel
from paratrain.train.build import build_model
from paratrain.train.engine import FlatEngine
from paratrain.train.step import train_step
from tests.equivalence import tiny_config

SCALING_OPS = ("aten.mul_.", "aten._foreach_mul_.", "aten.div_.", "aten._foreach_div_.")


class GradientScalings(TorchDispatchMode):
    """Counts the calls that multiply or divide gradients in place (autograd's own
    accumulation adds; the optimizer only reads them)."""

    def __init__(self, grads: Callable[[], set[int]]) -> None:
        super().__init__()
        self.grads, self.calls = grads, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if str(func).startswith(SCALING_OPS):
            first = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            if any(t.data_ptr() in self.grads() for t in first):
                self.calls += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("grad_clip", [1e-3, 1e6], ids=["clipped", "not-clipped"])
def test_one_pass_scales_the_gradients_whether_or_not_the_step_clips(grad_clip):
    cfg = tiny_config()
    model = build_model(cfg)
    engine = FlatEngine(DataParallel(model, Mesh.build(dp=1).group("dp"), reduce_op="sum"))
    optimizer = engine.build_optimizer(1e-3, 0.1, (0.9, 0.95))
    torch.manual_seed(0)
    batches = [torch.randint(0, cfg.model.vocab_size, (2, 17)) for _ in range(2)]
    train_step(engine, optimizer, batches, 1e-3, grad_clip)  # the optimizer's state exists

    def grads() -> set[int]:
        return {p.grad.data_ptr() for p in model.parameters() if p.grad is not None}

    counter = GradientScalings(grads)
    with counter:
        out = train_step(engine, optimizer, batches, 1e-3, grad_clip)
    assert (out.grad_norm > grad_clip) == (grad_clip < 1)  # the case clips, or does not
    assert counter.calls == 1
