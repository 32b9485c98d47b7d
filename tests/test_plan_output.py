"""What `paratrain plan` shows a user first (issue 30): the recommendation and the fastest
layout that fits on top, the best 15 layouts by step time, MFU against the datasheet peak,
JSON alone on stdout, and a chart only when asked."""

from __future__ import annotations

import json

from paratrain.cli import main
from paratrain.plan.chart import chart_layouts
from paratrain.plan.cluster import cluster_preset, cluster_with
from paratrain.plan.layout import Workload
from paratrain.plan.model import model_preset
from paratrain.plan.recommend import plan
from paratrain.plan.summary import DEFAULT_ROWS, fastest_fitting

LLAMA_64 = ["--preset", "llama3-8b", "--gpus", "64"]


def table_rows(out: str) -> list[list[str]]:
    """The layout rows of the table: after the header, up to the first blank-ish line."""
    lines = out.splitlines()
    start = next(i for i, x in enumerate(lines) if x.startswith("layout ")) + 1
    rows = []
    for line in lines[start:]:
        if not line.startswith(("* ", "  tp")):
            if line.startswith("    ZeRO-2"):
                continue
            break
        rows.append(line.split())
    return rows


def test_json_is_the_whole_stdout_and_nothing_is_written_unasked(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["plan", *LLAMA_64, "--json"]) == 0
    out = capsys.readouterr().out
    data = json.loads(out)  # the whole of stdout is one JSON document
    assert data["recommended"] and len(data["layouts"]) > DEFAULT_ROWS
    assert data["fastest"]["step_time_s"] == min(
        e["step_time_s"] for e in data["layouts"] if e["fits"]
    )
    assert list(tmp_path.iterdir()) == []  # no runs/plan.png unless --chart


def test_default_view_is_the_best_by_step_time_recommendation_first(capsys):
    assert main(["plan", *LLAMA_64]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("recommended: ") and "why: " in lines[0]
    assert lines[1].startswith("fastest that fits: ") and "trades that speed for" in lines[1]
    rows = table_rows(out)
    assert len(rows) == DEFAULT_ROWS and rows[0][0] == "*"
    steps = [float(r[-4]) for r in rows[1:]]  # the step column, the rest by time
    assert steps == sorted(steps)
    assert "--all lists them" in out and len(lines) < 60


def test_all_and_sort_memory(capsys):
    assert main(["plan", *LLAMA_64, "--all", "--sort", "memory"]) == 0
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert len(rows) > 100 and "rejected (" in out
    totals = [float(r[8]) for r in rows[1:]]  # layout, K, 6 memory columns, total
    assert totals == sorted(totals)


def test_mfu_is_against_the_datasheet_peak_with_the_efficiency_apart(capsys):
    assert main(["plan", *LLAMA_64, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    # the seeds' 1e14 FLOP/s effective is 32% of an A100's 312 TFLOP/s: MFU cannot pass it
    assert 0 < data["recommended"]["mfu"] <= 1e14 / 312e12
    assert main(["plan", *LLAMA_64]) == 0
    out = capsys.readouterr().out
    assert "peak 312 TFLOP/s per GPU (datasheet), efficiency 32% (calibrated)" in out


def test_help_says_what_each_cluster_preset_is(capsys):
    import pytest

    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "seeds-80gb-nvlink300-ib50-1e14: the seeds' textbook cluster" in out
    assert "a100-80gb-nvlink300-ib25: DGX A100" in out


def test_chart_only_when_asked_and_shows_recommended_and_fastest(capsys, tmp_path):
    cluster = cluster_with(cluster_preset("seeds-80gb-nvlink300-ib50-1e14"), gpus=64)
    result = plan(model_preset("llama3-8b"), cluster, Workload(global_batch=512))
    shown = chart_layouts(result, "memory", max_layouts=5)
    assert shown[0] is result.recommended and fastest_fitting(result) in shown
    path = tmp_path / "c.png"
    assert main(["plan", "--preset", "7b", "--dp", "8", "--chart", str(path)]) == 0
    assert path.stat().st_size > 1000 and f"chart: {path}" in capsys.readouterr().out
