"""`paratrain bench zero`: a tiny real run of ours against DDP + ZeroRedundancyOptimizer and
FSDP2, the loss check, the byte counts, the PNG and the flags.

2 ranks, 2 timed pairs and a 2-layer GPT (d_model 32, so every unit divides by 2 and there
is no padding). Both sides do the same float32 arithmetic on the same batches, so losses
and final parameters agree to rounding (in practice exactly). Bytes: ours match the
planner's closed form plus AdamW's step counters (`other`); the ZeRO-3 peer holds the same
16N/k; the ZeRO-1/2 peer holds 8N of parameters and gradients whole and AdamW state for
its parameter-whole partition, which sums to 8N over both ranks. No timing is asserted.
"""

from __future__ import annotations

import pytest

from paratrain import cli
from paratrain.bench.zero import LOSS_RTOL, VARIANTS, run_zero_comparisons
from paratrain.bench.zero_report import plot_state_bytes, summarize
from tests.equivalence import tiny_config, tiny_data

KEYS = {
    "variant", "ours_step_s", "torch_step_s", "ratio", "ours_state_bytes",
    "torch_state_bytes", "predicted_state_bytes", "max_param_diff",
}  # fmt: skip


def test_ours_and_torch_agree_and_hold_the_predicted_bytes(tmp_path):
    cfg = tiny_config(global_batch=4)
    entries = run_zero_comparisons(2, list(VARIANTS), cfg, tiny_data().train)
    by_name = {e["variant"]: e for e in entries}
    n = entries[0]["params"]
    for e in entries:
        assert KEYS <= e.keys()
        assert e["pairs"] == 2
        assert e["max_loss_rel_diff"] < LOSS_RTOL
        assert e["max_param_diff"] < 1e-5
        for kinds in e["ours_state_by_kind"]:  # the formula, plus step counters
            assert kinds["padding"] == 0
            for kind in ("params", "grads", "optimizer"):
                assert kinds[kind] == e["predicted_by_kind"][kind]
            assert kinds["other"] < 64
    assert by_name["zero1"]["predicted_state_bytes"] == 8 * n + 8 * n // 2
    assert by_name["zero2"]["predicted_state_bytes"] == 4 * n + 12 * n // 2
    assert by_name["zero3"]["predicted_state_bytes"] == 16 * n // 2
    for kinds in by_name["zero3"]["torch_state_by_kind"]:
        assert kinds["params"] == kinds["grads"] == 4 * n // 2
        assert kinds["optimizer"] == 8 * n // 2
    peer = by_name["zero1"]["torch_state_by_kind"]
    assert all(k["params"] == k["grads"] == 4 * n for k in peer)
    assert sum(k["optimizer"] for k in peer) == 8 * n

    png = tmp_path / "zero.png"
    plot_state_bytes(entries, str(png))
    assert png.stat().st_size > 0


def test_diverging_losses_fail_the_bench():
    rows = [(1.0, 1.0, 5.0, 5.0), (1.0, 1.0, 3.0, 3.1)]
    results = [{"rows": rows, "ours_bytes": {}, "torch_bytes": {}, "diff": 0.0}] * 2
    with pytest.raises(RuntimeError, match="losses differ"):
        summarize(VARIANTS["zero1"], results, 10, {"total": 0})


def test_too_few_pairs_and_unknown_variants_are_one_line_errors(capsys):
    assert cli.main(["bench", "zero", "--pairs", "3"]) == 2
    assert "at least 4 pairs" in capsys.readouterr().err
    assert cli.main(["bench", "zero", "--variants", "zero9", "--out", ""]) == 2
    assert "zero9" in capsys.readouterr().err
