"""`paratrain bench muon`: a tiny real run of both comparisons and the training curves.

2 ranks, 4 timed pairs and a 2-layer GPT, without clipping: ours and the peers
(torch.optim.Muon with AdamW under DDP, and the same under ZeroRedundancyOptimizer) do the
same arithmetic on the same batches, and a 2-rank sum is order-free, so losses and final
parameters agree exactly (the bench's own check allows 1e-4). No timing is asserted.
"""

from __future__ import annotations

import pytest

from paratrain.bench.muon.run import run_muon_bench
from tests.equivalence import tiny_config, tiny_data
from tests.test_cli_main import refused


def test_both_comparisons_agree_exactly_and_the_curves_are_recorded():
    result = run_muon_bench(pairs=4, steps=4, every=2, base=tiny_config(), data=tiny_data())
    for zero in (0, 1):
        summary = result[f"zero{zero}"]
        assert summary["pairs"] == 4 and summary["ratio"] > 0
        assert summary["max_loss_rel_diff"] == 0 and summary["max_param_diff"] == 0
    curves = result["curve"]["curves"]
    assert [s for s, _ in curves["muon"]] == [2, 4] == [s for s, _ in curves["adamw"]]
    assert curves["muon"] != curves["adamw"]  # two optimizers, two curves
    assert result["curve"]["adamw_final"] == curves["adamw"][-1][1]


@pytest.mark.parametrize("flag", [["--steps", "0"], ["--every", "0"], ["--pairs", "3"]])
def test_bad_flags_are_refused_in_one_line(flag, capsys):
    assert flag[0] in refused(capsys, "bench", "muon", *flag)
