"""Every data-parallel wrapper answers the one `Replica` protocol
(parallel/data_parallel/replica.py), with the protocol's signatures, so the training step
never needs to know which it has."""

from __future__ import annotations

import inspect

import pytest

from paratrain.mesh import Mesh
from paratrain.models.plans import GPT_PLAN
from paratrain.parallel.data_parallel import DataParallel
from paratrain.parallel.data_parallel.fsdp import FullyShardedDataParallel
from paratrain.parallel.data_parallel.fsdp_units import expand_units
from paratrain.parallel.data_parallel.replica import Replica
from paratrain.parallel.data_parallel.zero import ZeroDataParallel
from paratrain.train.build import build_model
from tests.equivalence import tiny_config

METHODS = [
    name
    for name, member in inspect.getmembers(Replica, inspect.isfunction)
    if not name.startswith("_")
]


def wrappers():
    group = Mesh.build().group("dp")  # one process: a group of one rank
    model = build_model(tiny_config())
    units = expand_units(model, GPT_PLAN.fsdp_units)
    yield DataParallel(build_model(tiny_config()), group)
    yield ZeroDataParallel(build_model(tiny_config()), group, stage=2)
    yield FullyShardedDataParallel(model, group, units)


def test_the_protocol_names_every_question_a_step_asks():
    assert set(METHODS) >= {
        "no_sync", "finish_gradient_sync", "zero_grad", "scale_grads_", "grad_squares",
        "all_reduce_grads_", "build_optimizer", "memory_report", "checkpoint_pieces",
        "after_load", "full_state_dict", "materialize",
    }  # fmt: skip


@pytest.mark.parametrize("wrapper", list(wrappers()), ids=lambda w: type(w).__name__)
def test_every_wrapper_answers_it_with_its_signatures(wrapper):
    assert isinstance(wrapper, Replica)
    for name in METHODS:
        ours = inspect.signature(getattr(type(wrapper), name))
        declared = inspect.signature(getattr(Replica, name))
        assert list(ours.parameters) == list(declared.parameters), (name, ours, declared)
