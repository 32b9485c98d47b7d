"""The line said at start about which op runs which algorithm is what choose_algo does
(issue 17: an op without the run-wide default's algorithm falls back to native, and says
so)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from paratrain.comm.algos import OTHER_OPS, OUR_ALGOS, algorithms_line, choose_algo
from paratrain.config import COMM_ALGOS


@pytest.mark.parametrize("default", [a for a in COMM_ALGOS if a != "native"])
def test_the_start_line_names_what_each_op_runs(default):
    group = SimpleNamespace(options=SimpleNamespace(algo=default))
    line = algorithms_line(default)
    ours, native = line.removeprefix(f"collectives: {default} for ").split("; native for ")
    assert set(ours.split(", ")) == {
        op for op in OUR_ALGOS if choose_algo(group, None, op) == default
    }
    assert set(native.split(", ")) == {
        op for op in OUR_ALGOS if choose_algo(group, None, op) == "native"
    } | set(OTHER_OPS)
