"""`paratrain bench dp` against DDP in miniature: 2 ranks, 2 pairs, a 2-layer GPT, clipping on.

Our loss (the global batch's mean) must equal the mean of DDP's per-rank losses at every
step, and the final parameters agree to rounding amplified by AdamW: the global norm is
above the clip (1.0) here, and the two sides' norms differ in their last bits (ours sums
squares in float64), which AdamW amplifies in cancelling gradients; without clipping the
two runs are bit-equal (tests/test_bench_zero.py). No timing is asserted.
"""

from __future__ import annotations

import pytest

from paratrain import cli
from paratrain.bench.dp.run import LOSS_RTOL, compare_ddp
from paratrain.bench.harness.pairs import check_mean_losses
from tests.equivalence import tiny_config, tiny_data


def test_ours_and_ddp_agree_with_clipping():
    cfg = tiny_config(global_batch=4)
    assert cfg.train.grad_clip == 1.0
    result = compare_ddp(2, 25.0, cfg, tiny_data().train)
    assert result["pairs"] == 2
    assert result["ratio_min"] <= result["ratio"] <= result["ratio_max"]
    assert result["max_loss_rel_diff"] < LOSS_RTOL
    assert result["max_param_diff"] < 1e-4
    assert "clip_grad_norm_(foreach=True) at 1.0" in result["peer"]


def test_our_global_loss_is_compared_with_the_mean_of_the_peers():
    # Rank 0 and 1 see different data: the peer's losses differ by rank, ours is global.
    assert check_mean_losses([[(4.0, 3.9)], [(4.0, 4.1)]], LOSS_RTOL) < 1e-12
    with pytest.raises(RuntimeError, match="losses differ at step 1"):
        check_mean_losses([[(5.0, 5.0), (3.0, 3.0)], [(5.0, 5.0), (3.0, 3.2)]], LOSS_RTOL)


def test_too_few_pairs_is_a_one_line_error(capsys):
    assert cli.main(["bench", "dp", "--pairs", "3"]) == 2
    assert "at least 4 pairs" in capsys.readouterr().err
