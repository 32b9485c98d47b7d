"""`paratrain bench tp`: a tiny real run of ours against DTensor, the loss check, the flags.

The real runs use 2 ranks, 2 timed pairs and a 2-layer GPT: the two implementations must
agree on every loss and on the final parameters, and the peer's bytes, counted from
CommDebugMode's collectives, must equal our ledger's to the byte without sequence
parallelism (the same all-reduces; the peer reduces the loss's max, sum and target logit
in three calls where we use two). No timing is asserted.
"""

from __future__ import annotations

import pytest

from paratrain import cli
from paratrain.bench.tp.run import LOSS_RTOL, _summarize, run_tp_comparisons
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

    sent = plain["bytes_per_rank_per_step"]
    assert sent["ours"] == sent["torch"] > 0
    ours, peer = plain["ops_per_step"]["ours"], plain["ops_per_step"]["torch"]
    assert set(ours) == set(peer) == {"all_reduce"}
    # Per block 2 forward + 2 backward; the embedding's g and the head's f; the loss.
    n_layer = cfg.model.n_layer
    assert ours["all_reduce"]["calls"] == 4 * n_layer + 2 + 2
    assert peer["all_reduce"]["calls"] == 4 * n_layer + 2 + 3

    # Sequence parallel: the activations' reduce-scatters are the same; the all-gathers
    # differ by the peer's position-embedding gradient gather, the all-reduces by how
    # replicated gradients are summed (docstring of paratrain.bench.tp).
    ours, peer = seq["ops_per_step"]["ours"], seq["ops_per_step"]["torch"]
    assert ours["reduce_scatter"] == peer["reduce_scatter"]
    assert peer["all_gather"]["calls"] == ours["all_gather"]["calls"] + 1


def test_diverging_losses_fail_the_bench():
    rows = [(0.0, 0.0, 5.0, 5.0), (1.0, 1.0, 4.0, 4.0), (1.0, 1.0, 3.0, 3.1)]
    results = [
        {"rows": rows, "ours_bytes": 1, "torch_bytes": 1, "ours_ops": {}, "torch_ops": {},
         "torch_comm_counts": {}, "max_param_diff": 0.0}
    ]  # fmt: skip
    with pytest.raises(RuntimeError, match="losses differ"):
        _summarize(results, sp=False)


def test_too_few_pairs_is_a_one_line_error(capsys):
    assert cli.main(["bench", "tp", "--pairs", "3"]) == 2
    assert "at least 4 pairs" in capsys.readouterr().err
