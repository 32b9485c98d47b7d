"""`paratrain bench zero`: a tiny real run of every stage against its PyTorch peer, the
closed forms, the loss check and the flags.

2 ranks, 2 timed pairs and a 2-layer GPT (d_model 32, so every flat unit divides by 2
and there is no padding), without clipping: both sides still take the global gradient
norm (and its bytes are counted), but do not scale by it, so they do the same float32
arithmetic on the same batches, a 2-rank sum is order-free, and losses and final
parameters agree to rounding (in practice exactly). With clipping, the norms differ in
their last bits (ours sums squares in float64) and AdamW amplifies that in cancelling
gradients; tests/test_bench_dp.py covers that path.

Bytes held: ours are the planner's closed form plus the itemised padding (zero here),
exactly; the peers hold 16N (DDP), 16N/k (FSDP2, with or without resharding after
forward), and for DDP + ZeroRedundancyOptimizer 8N whole plus AdamW state for a
parameter-whole partition that sums to 8N over the ranks. Bytes sent: ours
are the ZeRO paper's 2(k-1)S/k (stages 0-2) and 3(k-1)S/k (stage 3), S = 4N, plus the
bookkeeping scalars of our one training step (the (loss, tokens) pair and, under ZeRO,
the gradient norm's squared sums), exactly; the peers' are their strategy's plus what
their gradient norm sends (FSDP2's DTensor norm: one all-reduce), counted apart.
No timing is asserted.
"""

from __future__ import annotations

import json

import pytest

from paratrain import cli
from paratrain.bench.zero.compare import LOSS_RTOL
from paratrain.bench.zero.formulas import formula_state
from paratrain.bench.zero.report import check_stage_losses
from paratrain.bench.zero.run import run_zero_bench
from tests.equivalence import tiny_config, tiny_data

KEYS = {
    "zero", "dp", "dtype", "ours_step_s", "torch_step_s", "ratio", "params",
    "model_state_bytes_per_rank", "formula_bytes_per_rank", "comm_bytes_per_rank_per_step",
    "max_param_diff",
}  # fmt: skip


def test_every_stage_matches_its_peer_the_formula_and_the_paper(tmp_path):
    png = tmp_path / "zero.png"
    cfg = tiny_config(global_batch=4, grad_clip=0.0)
    result = json.loads(json.dumps(run_zero_bench(2, None, str(png), 2, cfg, tiny_data().train)))
    entries = result["stages"]
    assert [e["stage"] for e in entries] == [0, 1, 2, 3, "hsdp"]
    n, k = entries[0]["params"], 2
    closed = {0: 16 * n, 1: 8 * n + 8 * n // k, 2: 4 * n + 12 * n // k, 3: 16 * n // k}
    closed["hsdp"] = 16 * n  # 2 replica groups of one rank: ZeRO-3 over 1 rank holds all
    for e in entries:
        z = e["stage"]
        assert KEYS <= e.keys()
        assert (e["dp"], e["dtype"], e["pairs"]) == (k, "float32", 2)
        assert e["max_loss_rel_diff"] < LOSS_RTOL
        assert e["max_param_diff"] < 1e-5
        assert e["formula_bytes_per_rank"] == closed[z]
        assert len(e["model_state_bytes_per_rank"]) == k
        held = e["model_state_bytes_per_rank"]
        for b, pad in zip(held, e["padding_bytes_per_rank"], strict=True):
            assert b - pad == e["formula_bytes_per_rank"]
        s = 4 * n
        assert e["comm_formula_bytes"] == (3 * s // 2 if z == 3 else s)  # hsdp: all-reduce
        # (loss, tokens), 16 bytes, all-reduced over 2 ranks; under ZeRO the norm's too
        # (not under HSDP here: a replica group of one rank holds its whole gradient)
        assert e["comm_scalar_bytes_by_rank"] == [16 if z in (0, "hsdp") else 32] * k
        sent, scalars = e["comm_bytes_by_rank"], e["comm_scalar_bytes_by_rank"]
        assert sent == [e["comm_formula_bytes"] + x for x in scalars]
        assert e["torch_comm_unsized"] == {}
    by_stage = {e["stage"]: e for e in entries}
    assert by_stage["hsdp"]["torch_model_state_bytes_per_rank"] == [16 * n] * k
    assert by_stage[0]["torch_model_state_bytes_per_rank"] == [16 * n] * k
    for z in (2, 3):  # FSDP2 reshards after backward either way
        assert by_stage[z]["torch_model_state_bytes_per_rank"] == [16 * n // k] * k
    peer = by_stage[1]["torch_state_by_kind_per_rank"]
    assert all(kinds["params"] == kinds["grads"] == 4 * n for kinds in peer)
    assert sum(kinds["optimizer"] for kinds in peer) == 8 * n
    assert by_stage[0]["torch_comm_bytes_by_op"] == {"all_reduce": 4 * n}  # DDP's ring
    for z in (0, 1):  # DDP's gradients are whole: its norm is local
        assert by_stage[z]["torch_comm_norm_bytes_by_op"] == {}
    # FSDP2: gather once, reduce-scatter once, and the DTensor norm's all-reduce
    norm = by_stage[2]["torch_comm_norm_bytes_by_op"]
    assert set(norm) == {"all_reduce"} and norm["all_reduce"] > 0
    assert by_stage[2]["torch_comm_bytes_per_rank_per_step"] == 4 * n + norm["all_reduce"]
    assert result["png"] == str(png) and png.stat().st_size > 0


def test_closed_forms_for_float32_and_mixed_precision():
    n, k = 1000, 4
    fp32 = [formula_state(n, z, k, "float32")["total"] for z in range(4)]
    assert fp32 == [16 * n, 8 * n + 8 * n // k, 4 * n + 12 * n // k, 16 * n // k]
    mixed = [formula_state(n, z, k, "bfloat16")["total"] for z in range(4)]
    assert mixed == [16 * n, 4 * n + 12 * n // k, 2 * n + 14 * n // k, 16 * n // k]


def test_diverging_losses_fail_the_bench():
    results = [{"losses": [(5.0, 5.0), (3.0, 3.1)]}] * 2
    with pytest.raises(RuntimeError, match="losses differ"):
        check_stage_losses(1, results)


def test_too_few_pairs_and_unknown_stages_are_one_line_errors(capsys):
    assert cli.main(["bench", "zero", "--pairs", "3"]) == 2
    assert "at least 4 pairs" in capsys.readouterr().err
    assert cli.main(["bench", "zero", "--stages", "1,9", "--out", ""]) == 2
    assert "--stages '1,9'" in capsys.readouterr().err


def test_hsdp_row_at_dp_4_shards_over_2_and_all_reduces_across_2():
    """The HSDP row at dp 4 (2 replica groups of 2) against FSDP2 on a (2, 2) mesh: both
    hold 16N/2 per rank; ours sends ZeRO-3's 3 (s-1) S / s over a replica group plus the
    shard's all-reduce over the 2 groups, 2 (R-1)/R of S/2, to the byte, beside the
    planner's scalars; losses agree with the peer's."""
    cfg = tiny_config(global_batch=4, grad_clip=0.0)
    result = run_zero_bench(1, ["hsdp"], None, 4, cfg, tiny_data().train)
    (e,) = result["stages"]
    n, s = e["params"], 4 * e["params"]
    assert (e["stage"], e["zero"], e["replicas"], e["dp"]) == ("hsdp", 3, 2, 4)
    assert e["formula_bytes_per_rank"] == 16 * n // 2
    assert e["torch_model_state_bytes_per_rank"] == [16 * n // 2] * 4
    assert e["comm_formula_bytes"] == 3 * s // 2 + s // 2  # in the group; across: S/2
    sent, scalars = e["comm_bytes_by_rank"], e["comm_scalar_bytes_by_rank"]
    assert sent == [e["comm_formula_bytes"] + x for x in scalars]
    assert e["max_loss_rel_diff"] < LOSS_RTOL
