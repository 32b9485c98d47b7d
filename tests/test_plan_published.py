"""The planner against published runs (plan/published.py, plan/published_check.py).

Pure arithmetic: every number here is the planner's, compared with figures the papers
publish. One efficiency per hardware preset, fitted on one run; nothing per run.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from paratrain.cli import main
from paratrain.plan import stage_time
from paratrain.plan import time as ptime
from paratrain.plan.cluster import A100_EFFICIENCY, CLUSTER_PRESETS
from paratrain.plan.published import (
    CALIBRATION_RUNS,
    LAYOUT_COMPARISONS,
    NARAYANAN_TABLE_1,
    PUBLISHED_RUNS,
    PublishedRun,
)
from paratrain.plan.published_check import (
    TOLERANCE,
    compare_published,
    fit_efficiency,
    predict_published,
    predicted_tflops,
    ranking,
    ranking_agrees,
    run_published,
)

A100 = "a100-80gb-nvlink300-ib25"


def test_every_published_run_within_tolerance():
    rows = compare_published()
    assert len(rows) == len(PUBLISHED_RUNS) == 11
    off = {r.run.name: f"{r.error:+.1%}" for r in rows if abs(r.error) > TOLERANCE}
    assert not off, f"off by more than {TOLERANCE:.0%}: {off}"


def test_runs_carry_no_efficiency_of_their_own():
    """No per-run factor: a run is its model, layout, workload and cluster preset only."""
    names = {f.name for f in dataclasses.fields(PublishedRun)}
    assert not names & {"utilisation", "efficiency", "factor", "scale"}
    for run in PUBLISHED_RUNS:
        assert run.cluster_spec().utilisation == CLUSTER_PRESETS[run.cluster].utilisation


def test_the_a100_efficiency_is_fitted_on_its_one_run():
    run = CALIBRATION_RUNS["A100"]
    assert (run.name, run.tp, run.pp) == ("1.7B", 1, 1)
    assert fit_efficiency(run) == A100_EFFICIENCY
    assert predicted_tflops(run) == pytest.approx(137, abs=0.1)
    # the other A100 cluster (BLOOM's) shares the GPU's efficiency, not a fit of its own
    assert CLUSTER_PRESETS["a100-80gb-nvlink300-ib6-omnipath"].utilisation == A100_EFFICIENCY


def test_narayanan_eq3_by_hand():
    """eq. 3: 96 B s l h^2 (1 + s / (6h) + V / (16 l h)) with recomputation; for the 1.7B
    row, B = 512, s = 2048, l = 24, h = 2304, V = 51200:
    96 * 512 * 2048 * 24 = 2,415,919,104, times 2304^2 = 5,308,416: 12,824,703,626,379,264;
    times 1 + 2048/13824 + 51200/884736 = 1 + 0.148148 + 0.057870 = 1.206019: 1.5467e16."""
    run = NARAYANAN_TABLE_1[0]
    tokens = 512 * 2048
    base = 96 * 512 * 2048 * 24 * 2304**2
    assert base == 12_824_703_626_379_264
    eq3 = base * (1 + 2048 / (6 * 2304) + 51200 / (16 * 24 * 2304))
    assert eq3 == pytest.approx(1.5467e16, rel=1e-4)
    assert ptime.model_training_flops(run.model(), tokens, "full") == pytest.approx(eq3, rel=1e-12)
    # without recomputation 3 passes of the layers, still 3 of the head (6 B s h V)
    no_recompute = 72 * 512 * 2048 * 24 * 2304**2 * (1 + 2048 / 13824) + 6 * tokens * 2304 * 51200
    assert ptime.model_training_flops(run.model(), tokens) == pytest.approx(no_recompute)
    # a model given by its nominal N keeps the seeds' 6 N T
    assert ptime.model_training_flops(dataclasses.replace(run.model(), n_params=10), 3) == 180


def test_model_tflops_and_mfu_are_flops_over_step_time():
    run = NARAYANAN_TABLE_1[-1]
    est = predict_published(run)
    flops = ptime.model_training_flops(run.model(), run.global_batch * run.seq_len, "full")
    expected = flops / (run.gpus * est.time.total_s) / 1e12
    assert est.model_tflops_per_gpu == pytest.approx(expected)
    assert est.mfu == pytest.approx(expected / 312)
    # the step: busiest stage's matmuls and pointwise bytes, bubble, exposed traffic
    t = est.time
    assert t.total_s == pytest.approx(t.compute_s + t.bubble_s + t.exposed_comm_s)
    assert 0 < t.memory_s < t.compute_s


def test_pointwise_bytes_by_hand():
    """22h + 16h/t (+ 13 a s / t with scores) bytes per layer and token forward, x4 with full
    recomputation (forward, recomputed forward, backward twice)."""
    run = NARAYANAN_TABLE_1[-1]  # h 25600, a 160, s 2048, t 8
    h, a, s, t = 25600, 160, 2048, 8
    forward = 22 * h + 16 * h / t + 13 * a * s / t
    got = stage_time.pointwise_bytes_per_token(run.model(), run.workload(), t)
    assert got == pytest.approx(4 * forward)
    fused = dataclasses.replace(run.workload(), attention="fused", recompute="none")
    assert stage_time.pointwise_bytes_per_token(run.model(), fused, t) == pytest.approx(
        3 * (22 * h + 16 * h / t)
    )


def test_the_efficiency_moves_every_prediction():
    for run in PUBLISHED_RUNS:
        low, mid, high = (predicted_tflops(run, e) for e in (0.5, A100_EFFICIENCY, 0.8))
        assert low < mid < high, run.name


def test_published_command_fails_when_the_efficiency_is_wrong(monkeypatch, capsys):
    assert run_published() == 0
    wrong = dataclasses.replace(CLUSTER_PRESETS[A100], utilisation=0.45)
    monkeypatch.setitem(CLUSTER_PRESETS, A100, wrong)
    assert run_published() == 1
    assert "off: " in capsys.readouterr().out


def test_planner_orders_layouts_as_the_paper_does():
    for comparison in LAYOUT_COMPARISONS:
        assert ranking_agrees(comparison), (comparison.name, ranking(comparison))
    fig13 = ranking(LAYOUT_COMPARISONS[0])
    assert fig13[0][0] == "tp8.pp8.dp1.z0.1f1b"


def test_interleaving_and_scatter_gather_help_as_the_paper_reports():
    """Section 5.1 runs use both; each, switched off, makes the planner slower."""
    run = NARAYANAN_TABLE_1[8]  # 529.6B, interleaved x3
    plain = dataclasses.replace(run, chunks=1, schedule="1f1b")
    whole = dataclasses.replace(run, pp_scatter_gather=False)
    assert predicted_tflops(plain) < predicted_tflops(run)
    assert predicted_tflops(whole) < predicted_tflops(run)


def test_cli_published_and_json_fields(capsys):
    assert main(["plan", "--published"]) == 0
    out = capsys.readouterr().out
    assert "| 1.7B (fitted on) | tp1.pp1.dp32.z0 (32, 16, 512) | 137 | 137.0 | +0.0% |" in out
    assert "11 of 11 runs within 15%" in out
    args = (
        "plan --preset a100-80gb-nvlink300-ib25 --gpus 32 --layers 24 --hidden 2304 --heads 24 "
        "--vocab 51200 --seq-len 2048 --tp 1 --pp 1 --dp 32 --zero 0 --global-batch 512 "
        "--micro-batch 16 --recompute full --attention scores --overlap 1 --no-chart --json"
    )
    assert main(args.split()) == 0
    lines = capsys.readouterr().out.splitlines()
    (layout,) = json.loads(lines[-1])["layouts"]
    assert layout["model_tflops_per_gpu"] == pytest.approx(137.0, abs=0.1)
    assert layout["mfu"] == pytest.approx(137.0 / 312, abs=1e-3)
    assert main(args.replace(" --json", "").split()) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "TFLOP/s" in next(x for x in lines if x.startswith("layout"))
