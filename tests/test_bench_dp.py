"""`paratrain bench dp` against DDP in miniature: 2 ranks, 2 pairs, a 2-layer GPT.

Both sides take the global gradient norm and neither clips by it (`norm_only`: clipping by
norms equal to the last bits, ours summed in float64, lets AdamW drift the two apart), so
the two runs do the same float32 arithmetic and must agree bit for bit: our loss (the
global batch's mean) equals the mean of DDP's per-rank losses at every step, and the final
parameters are equal. No timing is asserted.
"""

from __future__ import annotations

import pytest

from paratrain import cli
from paratrain.bench.dp.run import LOSS_RTOL, compare_ddp
from paratrain.bench.harness.pairs import check_mean_losses
from tests.equivalence import tiny_config, tiny_data


def test_ours_and_ddp_agree_bit_for_bit_norm_to_norm():
    cfg = tiny_config(global_batch=4)
    assert cfg.train.grad_clip == 1.0  # the bench turns it off for both sides
    result = compare_ddp(2, 25.0, cfg, tiny_data().train)
    assert result["pairs"] == 2
    assert result["ratio_min"] <= result["ratio"] <= result["ratio_max"]
    assert result["max_loss_rel_diff"] == 0.0
    assert result["max_param_diff"] == 0.0
    assert "clip_grad_norm_(foreach=True) at 0.0" in result["peer"]


def test_our_global_loss_is_compared_with_the_mean_of_the_peers():
    # Rank 0 and 1 see different data: the peer's losses differ by rank, ours is global.
    assert check_mean_losses([[(4.0, 3.9)], [(4.0, 4.1)]], LOSS_RTOL) < 1e-12
    with pytest.raises(RuntimeError, match="losses differ at step 1"):
        check_mean_losses([[(5.0, 5.0), (3.0, 3.0)], [(5.0, 5.0), (3.0, 3.2)]], LOSS_RTOL)


def test_too_few_pairs_is_a_one_line_error(capsys):
    assert cli.main(["bench", "dp", "--pairs", "3"]) == 2
    assert "at least 4 pairs" in capsys.readouterr().err
