"""`paratrain bench pp` in miniature: 2 ranks, 2 pairs, one schedule, K = 2.

Asserts the result's shape and the facts that do not depend on timing: both sides' losses
agree (the bench itself fails otherwise), the peak in-flight count is 1F1B's S - stage,
and the Gantt chart and Chrome trace are written. No speed is asserted.
"""

from __future__ import annotations

import json

import pytest

from paratrain.bench.pp.run import run_pp_bench
from paratrain.cli import main


def test_bench_pp_smoke(tmp_path):
    text = tmp_path / "corpus.txt"  # a small file instead of the default corpus: 5 s less
    text.write_text("".join(f"line {i}: the quick brown fox {i * i}\n" for i in range(400)))
    result = run_pp_bench(["1f1b"], pairs=2, microbatches=2, out=str(tmp_path), data=str(text))
    (entry,) = result["schedules"]
    assert entry["schedule"] == "1f1b" and entry["peer"] == "Schedule1F1B"
    assert entry["pairs"] == 2
    assert entry["ours_step_s"] > 0 and entry["torch_step_s"] > 0
    assert entry["ratio_min"] <= entry["ratio"] <= entry["ratio_max"]
    assert entry["max_loss_rel_diff"] <= result["loss_rtol"]
    assert entry["peak_in_flight"] == [2, 1] == entry["peak_in_flight_simulated"]
    assert 0.0 <= entry["bubble_measured"] < 1.0
    assert len(entry["bubble_measured_per_stage"]) == 2
    assert entry["bubble_formula"] == pytest.approx(1 / 3)  # (S-1)/(K+S-1), S = K = 2
    with open(entry["gantt"], "rb") as f:
        assert f.read(4) == b"\x89PNG"
    with open(entry["trace"]) as f:
        events = json.load(f)["traceEvents"]
    assert {e["name"] for e in events if e["ph"] == "X"} >= {"F0", "F1", "B0", "B1"}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--schedules", "pipedream"], "valid: gpipe, 1f1b, interleaved, zb-h1"),
        (["--pairs", "1"], "at least 2 pairs"),
        (["--schedules", "interleaved", "--microbatches", "3"], "not a multiple"),
    ],
)
def test_bad_flags_exit_2_before_any_rank_starts(capsys, argv, message):
    assert main(["bench", "pp", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_losses_that_disagree_fail_the_bench():
    """Fabricated rows: the check is on the last rank, where both sides' losses live."""
    from paratrain.bench.harness.pairs import PairRow
    from paratrain.bench.pp.report import summarise
    from paratrain.parallel.pipeline import StepTrace

    def rank(losses: tuple[float, float]) -> dict:
        rows = [PairRow(0.1, 0.1, *losses), PairRow(0.1, 0.1, *losses)]
        return {
            "rows": rows,
            "micro_batch": 2,
            "warmup_losses": (5.5, 5.5),
            "bubbles": [0.1, 0.1],
            "peak_in_flight": 1,
            "trace": StepTrace(0, 0.0, 1.0),
        }

    assert summarise("1f1b", 2, [rank((5.0, 5.0)), rank((5.0, 5.0))])["ratio"] == 1.0
    with pytest.raises(RuntimeError, match="losses differ at step 1"):
        summarise("1f1b", 2, [rank((5.0, 5.0)), rank((5.0, 5.01))])
