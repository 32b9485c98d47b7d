"""The GPU check's two Python parts, run on the CPU: what scripts/gpu-check.sh runs on a GPU.

scripts/gpu_check.py's equivalence (tests/equivalence.py's reference, on the check's device):
a layout that trains like it passes and one that does not fails. The
throughput bench (paratrain/bench/gpu/throughput.py) runs its whole path on a tiny model;
its FLOPs formula and datasheet table are checked on their own. No speed is asserted.
"""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from scripts import gpu_check

from paratrain.bench.gpu import throughput
from paratrain.models.gpt import GPT
from paratrain.train.build import run_gpt_config
from tests import equivalence as eq

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def reference():
    cfg = gpu_check.layout_config(gpu_check.LAYOUTS[1][0], 1, "cpu")
    return gpu_check.device_reference(cfg, eq.tiny_data(), CPU)


def test_every_wrapper_at_world_one_passes(capsys):
    """In this process, no process group: DataParallel, ZeRO-1, ZeRO-2, FSDP at dp = 1."""
    status = gpu_check.main(["equivalence", "--device", "cpu", "--world", "1"])
    out = capsys.readouterr().out
    assert status == 0, out
    for title in ("DataParallel", "ZeRO-1", "ZeRO-2", "FSDP (ZeRO-3)"):
        assert f"| {title} | 1 | none |" in out and "FAIL" not in out
    assert "equivalence: 4 passed, 0 failed" in out


def test_two_gloo_ranks_pass():
    outcomes = gpu_check.check_world(2, "cpu", ["zero3", "tp-sp", "pp-1f1b"])
    assert [o.layout.key for o in outcomes] == ["zero3", "tp-sp", "pp-1f1b"]
    for o in outcomes:
        assert o.backend == "gloo" and not o.error, o.row()
        assert o.within()
        assert o.row().endswith("| PASS |")


def test_a_layout_that_crashes_is_named_and_the_others_still_report():
    """One set of ranks for all layouts; after a failure, one set per layout."""
    good = gpu_check.layout_config(gpu_check.LAYOUTS[2][0], 2, "cpu")
    bad = copy.deepcopy(good)
    bad.parallel.tp = 2  # dp 2 x tp 2 in a world of 2: the mesh refuses, in every rank
    trained = gpu_check.train_world(2, [good, bad], eq.tiny_data(), "cpu", "gloo")
    assert len(trained[0]) == 2 and trained[0][0].losses == trained[0][1].losses
    assert trained[1].startswith("RankFailed: ValueError: mesh dp=2 pp=1 tp=2 (world 4)")


def test_a_layout_that_trains_differently_fails(reference):
    record, _ = reference
    layout = gpu_check.LAYOUTS[2][0]
    same = gpu_check.compare(layout, 2, "gloo", [record, record], reference)
    assert not same.error and same.loss_rdiff == 0
    off = dataclasses.replace(record, losses=[x * (1 + 1e-5) for x in record.losses])
    outcome = gpu_check.compare(layout, 2, "gloo", [off, off], reference)
    assert outcome.error.startswith("step 1: loss") and "| FAIL: step 1: loss" in outcome.row()
    assert outcome.loss_rdiff == pytest.approx(1e-5, rel=1e-3)
    ranks_differ = gpu_check.compare(layout, 2, "gloo", [record, off], reference)
    assert ranks_differ.error == "ranks differ"


def test_throughput_bench_runs_tiny_on_the_cpu(capsys):
    assert throughput.main(["--device", "cpu", "--tiny", "--steps", "2", "--warmup", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    assert result["device"] == "CPU" and result["dtype"] == "float32"
    assert result["tokens_per_s"] > 0 and result["step_s"] > 0
    assert result["mfu"] is None and result["cuda_max_allocated_bytes"] is None
    assert "MFU: none on a CPU (no datasheet peak)" in lines
    # float32 DataParallel: 4 + 4 + 8 bytes per parameter, and the planner says the same
    assert result["model_state_bytes"]["total"] == 16 * result["params"]
    assert result["predicted_model_state_bytes"] == result["model_state_bytes"]
    assert all(loss == loss and 0 < loss < 10 for loss in result["losses"])  # finite


def test_model_flops_of_the_1b_config():
    """PaLM's 6N + 12·L·d·T with N the parameters of matrix products (not the embeddings)."""
    cfg = throughput.throughput_config("cpu")  # the 1B shape; the device does not matter here
    with torch.device("meta"):
        model = GPT(run_gpt_config(cfg))
    n = throughput.matmul_params(model)
    assert sum(p.numel() for p in model.parameters()) == 1_015_975_936
    assert n == 1_015_975_936 - 50304 * 2048 - 2048 * 2048
    per_token = throughput.model_flops_per_token(n, 16, 2048, 2048)
    assert per_token == 6 * n + 12 * 16 * 2048 * 2048 == 6_257_860_608


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H200", 989e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100 80GB PCIe", 312e12),
        ("NVIDIA L40S", 362e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA L40", None),  # not an L4
        ("Tesla V100-SXM2-16GB", None),
    ],
)
def test_datasheet_peak_by_device_name(name, peak):
    assert throughput.peak_bf16_flops(name) == peak


def test_the_report_names_the_layouts_skipped_for_lack_of_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    worlds = gpu_check.default_worlds("cuda")
    assert worlds == [1, 2]
    (line,) = gpu_check.skipped_lines("cuda", worlds)
    assert line.startswith("skipped for lack of GPUs (world 8 needs 8, this machine has 2)")
    assert gpu_check.LAYOUTS[8][0].title in line
    assert gpu_check.skipped_lines("cpu", [2]) == []
