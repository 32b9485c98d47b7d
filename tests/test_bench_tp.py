"""`paratrain bench tp`: a tiny real run of ours against DTensor, the loss check, the flags.

The real runs use 2 ranks, 2 timed pairs and a 2-layer GPT: the two implementations must
agree on every loss and on the final parameters, and without sequence parallelism the
peer's bytes, counted at the dispatcher, less its gradient norm's, must equal our
ledger's less our step's norm scalar, to the byte (the same all-reduces; the peer reduces
the loss's max, sum and target logit in three calls where we use two). No timing is
asserted.
"""

from __future__ import annotations

import pytest

from paratrain import cli
from paratrain.bench.harness.pairs import PairRow
from paratrain.bench.tp.report import LOSS_RTOL, summarize
from paratrain.bench.tp.run import run_tp_comparisons
from tests.equivalence import tiny_config, tiny_data

SUMMARY_KEYS = {"ours_step_s", "torch_step_s", "ratio", "bytes_per_rank_per_step", "max_param_diff"}


def test_ours_and_dtensor_agree_and_count_the_same_bytes():
    cfg = tiny_config(global_batch=4)
    plain, seq = run_tp_comparisons(2, (False, True), cfg, tiny_data().train)
    for result in (plain, seq):
        assert SUMMARY_KEYS <= result.keys()
        assert result["pairs"] == 2
        assert result["max_loss_rel_diff"] < LOSS_RTOL
        assert result["max_param_diff"] < 1e-4

    sent = plain["bytes_by_rank"]
    assert sent["ours_scalars"] == [8, 8]  # one float64 all-reduced over 2 ranks
    assert all(n > 0 for n in sent["torch_norm"])
    strategy = [o - s for o, s in zip(sent["ours"], sent["ours_scalars"], strict=True)]
    assert strategy == [t - n for t, n in zip(sent["torch"], sent["torch_norm"], strict=True)]
    assert min(strategy) > 0
    ours, peer = plain["ops_per_step"]["ours"], plain["ops_per_step"]["torch"]
    assert set(ours) == set(peer) == {"all_reduce"}
    # Per block 2 forward + 2 backward; the embedding's g and the head's f; the loss; the
    # gradient norm (ours: the squared sum of the split parameters; DTensor: full_tensor).
    n_layer = cfg.model.n_layer
    assert ours["all_reduce"]["calls"] == 4 * n_layer + 2 + 2 + 1
    assert peer["all_reduce"]["calls"] == 4 * n_layer + 2 + 3 + 1

    # Sequence parallel: the activations' reduce-scatters are the same; the all-gathers
    # differ by the peer's position-embedding gradient gather, the all-reduces by how
    # replicated gradients are summed (docstring of paratrain.bench.tp).
    ours, peer = seq["ops_per_step"]["ours"], seq["ops_per_step"]["torch"]
    assert ours["reduce_scatter"] == peer["reduce_scatter"]
    assert peer["all_gather"]["calls"] == ours["all_gather"]["calls"] + 1


def test_diverging_losses_fail_the_bench():
    rows = [PairRow(0.0, 0.0, 5.0, 5.0), PairRow(1.0, 1.0, 4.0, 4.0), PairRow(1.0, 1.0, 3.0, 3.1)]
    with pytest.raises(RuntimeError, match="losses differ at step 2"):
        summarize([{"rows": rows}], sp=False)


def test_too_few_pairs_is_a_one_line_error(capsys):
    assert cli.main(["bench", "tp", "--pairs", "3"]) == 2
    assert "at least 4 pairs" in capsys.readouterr().err
