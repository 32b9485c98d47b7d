"""`paratrain bench cp` and `paratrain bench moe`: one tiny real run each, and the checks
that fail them. No timing is asserted.

bench cp: ring and all-to-all attention at 2 ranks equal single-process attention within
the bench's float32 tolerance, and the ledger's bytes equal plan/context_cost.py's
formulas (the bench itself raises otherwise; the test reads the numbers back). bench moe:
the round trip through identity experts is exact and the ledger equals
plan/expert_cost.py's dispatch formula for both all-to-all algorithms, at two token counts.
"""

from __future__ import annotations

import pytest

from paratrain.bench.cp.run import expected_sent, run_cp_bench, summarize
from paratrain.bench.moe.run import run_moe_bench, tokens_sweep

SHAPE = {"batch": 1, "heads": 4, "kv_heads": 2, "seq": 32, "head_dim": 8}


def test_bench_cp_agrees_with_one_process_and_counts_the_formula():
    result = run_cp_bench(["ring", "alltoall"], SHAPE, pairs=2)
    ring, a2a = result["methods"]["ring"], result["methods"]["alltoall"]
    # Ring: 1 hop forward, 2 backward, each k and v of 16 tokens x 2 heads x 8 floats.
    assert ring["bytes_per_rank"] == {"send": 3 * 2 * 16 * 2 * 8 * 4}
    # All-to-all: per pass half of q, k, v and the output, (2h + 2h_kv) d e s/2 / 2.
    assert a2a["bytes_per_rank"] == {"all_to_all": 2 * 16 * (8 + 4) * 8 * 4 // 2}
    for s in (ring, a2a):
        assert s["pairs"] == 2 and s["max_relative_error"] < 1e-4
        assert min(s["saved_bytes"].values()) > 0
    assert "scaled_dot_product_attention" in result["peer"]


def test_bench_cp_fails_when_outputs_or_bytes_differ():
    ok = {"rows": [(1.0, 1.0)] * 2, "saved_bytes": {"ours": 1, "peer": 1}}
    sent = expected_sent("ring", SHAPE, 2)
    wrong = {**ok, "relative_errors": {"out": 1e-2, "dq": 0, "dk": 0, "dv": 0}, "sent": sent}
    with pytest.raises(RuntimeError, match="differs from single-process attention"):
        summarize("ring", [wrong, wrong], SHAPE)
    errors = {"out": 0.0, "dq": 0.0, "dk": 0.0, "dv": 0.0}
    extra = {**ok, "relative_errors": errors, "sent": {"send": (2, 1)}}
    with pytest.raises(RuntimeError, match="the formula says"):
        summarize("ring", [extra, extra], SHAPE)
    with pytest.raises(ValueError, match="--kv-heads 3"):
        run_cp_bench(["ring"], {**SHAPE, "kv_heads": 3}, 2)


def test_bench_moe_round_trip_and_bytes_against_tokens_per_rank():
    result = run_moe_bench([8, 32], d_model=4, experts=4, top_k=2, pairs=2)
    rows = result["sweep"]
    assert [r["tokens"] for r in rows] == [8, 32]
    assert all(r["pairs"] == 2 and r["bytes_per_rank"] > 0 for r in rows)
    assert rows[1]["bytes_per_rank"] > rows[0]["bytes_per_rank"]
    with pytest.raises(ValueError, match="--tokens"):
        tokens_sweep("8,x")
