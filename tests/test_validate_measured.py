"""`plan --validate` against measurements, not the code's own counters: bytes on the wire,
the bubble from the runtime's timestamps, activation bytes from the saved-tensor meter.

Pure tests first (canned measurements through the comparison), then the fused-attention
activation formula against the meter on one block, then one real case. Each would fail
with the numbers the code records itself: a wire measurement equal to the ledger's
formula fails the ZeRO rows (gloo's reduce-scatter sends twice that), and a bubble equal
to the slot model's fails when the runtime's timestamps say otherwise.
"""

from __future__ import annotations

import pytest
import torch

from paratrain.bench.planner.bubbles import BUBBLE_TOLERANCE, runtime_bubble
from paratrain.bench.planner.cases import CASES, small_config
from paratrain.bench.planner.on_wire import PREAMBLE_BOUND, wire_rows
from paratrain.measure.activations import ActivationMeter
from paratrain.models.gpt import Block, GPTConfig
from paratrain.plan import activations
from paratrain.plan.rank_traffic import Coords, bytes_by_axis, rank_traffic
from paratrain.plan.run_inputs import planner_inputs

FP32 = 4


def _canned(case_name: str, wire_bytes: int, calls: int) -> tuple:
    case = CASES[case_name]
    cfg = small_config(case, 2)
    model, w, _, _ = planner_inputs(cfg)
    step = {"wire": {"world+dp": [wire_bytes, 0]}, "calls": {("dp", "all_reduce"): calls}}
    m = {"coords": {"pp": 0, "dp": 0, "tp": 0}, "steps": [step, step]}
    return case, m, model, w


def _dp_formula(case_name: str) -> int:
    case = CASES[case_name]
    cfg = small_config(case, 2)
    terms = rank_traffic(*planner_inputs(cfg)[:2], case.layout, case.microbatches, Coords())
    return bytes_by_axis(terms)["dp"]


def test_wire_rows_pass_the_wire_and_fail_the_ledgers_formula():
    formula = _dp_formula("dp")
    (row,) = wire_rows(*_canned("dp", formula + 864, 2))  # + 2 calls' preambles
    assert row.ok and row.predicted == formula and row.bounds == (formula, formula + 2 * 1024)
    (row,) = wire_rows(*_canned("dp", formula - 1, 2))  # bytes missing: a broken meter
    assert not row.ok
    (row,) = wire_rows(*_canned("dp", formula + 3 * PREAMBLE_BOUND, 2))
    assert not row.ok
    # ZeRO-2: gloo's reduce-scatter is an all-reduce, so the ledger's number is too low.
    shard = _dp_formula("zero2-shard")
    (row,) = wire_rows(*_canned("zero2-shard", shard, 5))
    assert not row.ok and "gloo's reduce-scatter is an all-reduce" in row.note
    lo = row.bounds[0]
    (row,) = wire_rows(*_canned("zero2-shard", lo + 2016, 5))
    assert row.ok and lo - shard == 2 * 1_783_296  # twice (k-1)/k S per reduce-scatter


def _trace(start: float, end: float, busy: float) -> dict:
    return {"start": start, "end": end, "busy_s": busy}


def test_runtime_bubble_is_idle_over_stages_times_makespan():
    steps = [  # 2 stages, 2 steps: the first is skipped (warm-up)
        [{"trace": _trace(0, 9, 1)}, {"trace": _trace(10.0, 15.0, 4.0)}],
        [{"trace": _trace(0, 9, 1)}, {"trace": _trace(10.5, 15.5, 4.0)}],
    ]
    measured = [{"coords": {"pp": s, "dp": 0, "tp": 0}, "steps": steps[s]} for s in range(2)]
    bubble, span, samples = runtime_bubble(measured)
    assert samples == 1 and span == 5.5
    assert bubble == pytest.approx(1 - 8.0 / (2 * 5.5))


@pytest.mark.parametrize("s, b", [(64, 2), (32, 3)])
def test_fused_formula_is_what_a_block_saves(s, b):
    """One block, fp32: the meter's bytes equal the fused count exactly (tp 2 is measured
    whole-stage by plan --validate's tp and 3d cases)."""
    h, a = 64, 4
    torch.manual_seed(0)
    block = Block(GPTConfig(n_head=a, d_model=h))
    x = torch.randn(b, s, h, requires_grad=True)
    with ActivationMeter(block) as meter:
        block(x)
    fused = activations.fused_gpt_layer_activation_bytes(s, b, h, a, 1, element_bytes=FP32)
    assert meter.total == fused
    korthikanti = FP32 / 2 * activations.layer_activation_bytes(s, b, h, a, 1, "none")
    assert meter.total < 0.8 * korthikanti  # the s^2 scores the fused kernel does not keep


def test_validate_compares_with_measurements(capsys):
    """dp and 1F1B at pp 2, 2 steps: wire rows, the runtime bubble (slowed passes) and
    activation bytes, each within its bound."""
    from paratrain.bench.planner.run import run_validation

    assert run_validation(steps=2, cases=["dp", "1f1b"]) == 0
    out = capsys.readouterr().out
    assert " NO " not in out and "measured quantities within their stated bounds" in out
    rows = [line for line in out.splitlines() if line[:1] != " "]
    wire = [r for r in rows if "wire:" in r]
    assert wire and all(" yes " in r and "gloo preambles" in r for r in wire)
    (bubble,) = [r for r in rows if "bubble, runtime" in r]
    assert " yes " in bubble and f"+-{BUBBLE_TOLERANCE}" in bubble
    acts = [r for r in rows if "peak activation bytes" in r]
    assert acts and all(" yes " in r and "fused attention, no s^2 term" in r for r in acts)
