"""`paratrain plan` from the command line: the JSON contract, errors, the chart, --validate."""

from __future__ import annotations

import json

import pytest

from paratrain.cli import main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_json_is_the_last_line_with_the_seeds_numbers(capsys, tmp_path):
    code, out, _ = run(
        capsys,
        "--preset",
        "7b",
        "--dp",
        "8",
        "--zero",
        "1",
        "--json",
        "--chart",
        str(tmp_path / "c.png"),
    )
    assert code == 0
    data = json.loads(out.strip().splitlines()[-1])
    (entry,) = data["layouts"]
    assert entry["model_state_bytes_per_gpu"] == {
        "params": 14_000_000_000,
        "grads": 14_000_000_000,
        "grad_accumulation": 0,
        "optimizer": 7_000_000_000,
        "master": 3_500_000_000,
        "total": 38_500_000_000,
    }
    assert entry["comm_bytes_per_gpu"] == 24_500_000_000
    assert data["recommended"]["zero"] == 1
    assert (tmp_path / "c.png").stat().st_size > 1000
    assert "tp1.pp1.dp8.z1" in out  # the table
    assert "ZeRO-2 assumes" not in out  # the assumption line is for ZeRO-2 layouts only


def test_zero2_layout_answers_2n_plus_14n_over_k_by_default(capsys):
    """Issue 17: `plan --params 7e9 --gpus 8 --dp 8 --zero 2` (G = 512, so K = 64) answers
    ZeRO-2's model state as the seeds and the ZeRO paper count it, 2N + 14N/k = 14 + 12.25
    = 26.25 GB, charging accumulate shard (the runtime's default) and saying so in one
    line; `--zero2-accumulate full` keeps the old answer, 26.25 + the whole gradient 14."""
    base = ["--params", "7e9", "--gpus", "8", "--dp", "8", "--zero", "2", "--no-chart"]
    answers = {}
    for extra in ([], ["--zero2-accumulate", "full"]):
        code, out, _ = run(capsys, *base, *extra, "--json")
        assert code == 0
        (entry,) = json.loads(out)["layouts"]
        code, out, _ = run(capsys, *base, *extra)
        (line,) = [x for x in out.splitlines() if x.startswith("ZeRO-2 assumes")]
        (row,) = [x for x in out.splitlines() if x.startswith("* tp1.pp1.dp8.z2")]
        answers[entry["zero2_accumulate"]] = entry, line, row
    entry, line, row = answers["shard"]
    assert entry["microbatches"] == 64
    assert entry["model_state_bytes_per_gpu"] == {
        "params": 14_000_000_000,
        "grads": 1_750_000_000,
        "grad_accumulation": 0,
        "optimizer": 7_000_000_000,
        "master": 3_500_000_000,
        "total": 26_250_000_000,
    }
    assert entry["comm_bytes_per_gpu"] == 64 * 12.25e9 + 12.25e9  # K reduce-scatters
    assert "after every micro-batch (--zero2-accumulate shard" in line and "2N + 14N/k" in line
    assert row.split()[9] == "26.25"  # the total column ("*", layout, K, ..., act, total)
    entry, line, row = answers["full"]
    state = entry["model_state_bytes_per_gpu"]
    assert (state["grad_accumulation"], state["total"]) == (14_000_000_000, 40_250_000_000)
    assert entry["comm_bytes_per_gpu"] == 24_500_000_000
    assert "(--zero2-accumulate full)" in line and "plus 2N (g-acc)" in line
    assert row.split()[9] == "40.25"


def test_zero2_accumulate_flag_charges_one_option_and_shows_the_other(capsys):
    """7B, dp 8, K = 8 (docs/planner.md's example): the table row and its note line carry
    both options; the JSON's charged entry follows the flag, `zero2_alternative` the other."""
    base = ["--preset", "7b", "--dp", "8", "--zero", "2", "--microbatches", "8", "--no-chart"]
    entries = {}
    for option in ("full", "shard"):
        code, out, _ = run(capsys, *base, "--zero2-accumulate", option, "--json")
        assert code == 0
        (entries[option],) = json.loads(out)["layouts"]
        code, out, _ = run(capsys, *base, "--zero2-accumulate", option)
        assert "    ZeRO-2, K = 8, " + option in out and "(charged) | " in out
    full, shard = entries["full"], entries["shard"]
    assert full["model_state_bytes_per_gpu"]["grad_accumulation"] == 14_000_000_000
    assert full["model_state_bytes_per_gpu"]["total"] == 40_250_000_000
    assert shard["model_state_bytes_per_gpu"]["total"] == 26_250_000_000
    assert (full["comm_bytes_per_gpu"], shard["comm_bytes_per_gpu"]) == (24.5e9, 110.25e9)
    assert full["zero2_alternative"]["gradient_comm_bytes_per_gpu"] == 98_000_000_000
    assert shard["zero2_alternative"]["grad_accumulation"] == 14_000_000_000
    with pytest.raises(SystemExit) as exc:
        main(["plan", *base, "--zero2-accumulate", "half"])
    assert exc.value.code == 2 and "invalid choice: 'half'" in capsys.readouterr().err


def test_params_alone_and_overrides(capsys):
    code, out, _ = run(
        capsys, "--params", "13e9", "--activation-gb", "40", "--dp", "8", "--json", "--no-chart"
    )
    assert code == 0
    data = json.loads(out.strip().splitlines()[-1])
    fits = {e["zero"]: e["fits"] for e in data["layouts"]}
    assert fits == {0: False, 1: False, 2: False, 3: True}


def test_pipeline_layout_and_bubble(capsys):
    code, out, _ = run(
        capsys,
        "--preset",
        "13b",
        "--gpus",
        "8",
        "--tp",
        "2",
        "--pp",
        "4",
        "--dp",
        "1",
        "--schedule",
        "1f1b",
        "--global-batch",
        "8",
        "--json",
        "--no-chart",
    )
    assert code == 0
    (entry,) = json.loads(out.strip().splitlines()[-1])["layouts"]
    assert entry["bubble_fraction"] == 3 / 11


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--preset", "8b"], "unknown or given twice; valid: paratrain, gpt-tiny, gpt2-124m"),
        (["--precision", "fp8"], "unknown precision 'fp8'; valid: mixed, fp32, bf16"),
        (["--zero", "4"], "ZeRO stage 4; valid: 0, 1, 2, 3"),
        (["--dp", "3"], "no layout with dp=3 on 8 GPUs"),
        (["--gpus", "12"], "not a whole number of nodes"),
        (["--schedule", "zigzag"], "schedule 'zigzag'; valid: gpipe, 1f1b, interleaved"),
        (["--utilisation", "1.5"], "utilisation = 1.5; valid: 0 < u <= 1"),
        (["--micro-batch", "0"], "micro-batch 0; must be at least 1"),
        (["--params", "-1"], "--params -1.0; must be > 0"),
        (["--heads", "7"], "heads 7 do not divide hidden 4096"),
        (["--replicas", "2", "--zero", "0"], "--replicas 2 needs ZeRO 1, 2 or 3"),
        (["--replicas", "3", "--dp", "8"], "replicas divide dp"),
        (["--replicas", "0"], "--replicas 0"),
    ],
)
def test_bad_input_is_one_line_exit_2(capsys, argv, needle):
    code, out, err = run(capsys, *argv, "--no-chart")
    assert code == 2, out
    assert needle in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_replicas_shard_within_each_group_and_all_reduce_across(capsys):
    """`plan --replicas 2` on dp 8: only HSDP layouts (ZeRO 1-3), each holding the ZeRO
    state of a shard over 4 ranks (as dp 4 without replicas would), and all-reducing its
    gradient shard (7e9 bf16 gradients / 4) across the 2 groups: 2 (R - 1) / R of it."""

    def layouts(*argv: str) -> dict[str, dict]:
        code, out, _ = run(capsys, "--preset", "7b", "--tp", "1", "--pp", "1", *argv, "--json")
        assert code == 0
        return {e["zero"]: e for e in json.loads(out.strip().splitlines()[-1])["layouts"]}

    hsdp, flat = layouts("--dp", "8", "--replicas", "2"), layouts("--dp", "8")
    assert sorted(hsdp) == [1, 2, 3] and all(e["replicas"] == 2 for e in hsdp.values())
    half = layouts("--gpus", "4", "--dp", "4")
    for zero in (1, 2, 3):
        state = hsdp[zero]["model_state_bytes_per_gpu"]
        assert state == half[zero]["model_state_bytes_per_gpu"], zero
        across = [c for c in hsdp[zero]["comm"] if c["axis"] == "dp_replicate"]
        assert [(c["op"], c["bytes"]) for c in across] == [("all_reduce", 3_500_000_000)]
        assert all(c["axis"] != "dp_replicate" for c in flat[zero]["comm"])


def test_batch_arithmetic_that_fails_rejects_the_layout_with_its_numbers(capsys):
    code, out, _ = run(
        capsys,
        "--global-batch",
        "24",
        "--microbatches",
        "2",
        "--dp",
        "8",
        "--zero",
        "3",
        "--json",
        "--no-chart",
    )
    assert code == 0
    (entry,) = json.loads(out.strip().splitlines()[-1])["layouts"]
    assert not entry["fits"]
    assert "micro-batches 2 disagree with G / (b * dp) = 24 / (1 * 8) = 3" in entry["reason"]


def test_unknown_flag_is_argparse_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--bogus"])
    assert exc.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_validate_dp_and_tp_match_exactly(capsys):
    # The fast subset; `paratrain plan --validate` runs every case (docs/planner.md).
    from paratrain.bench.planner.run import run_validation

    assert run_validation(steps=2, cases=["dp", "tp"]) == 0
    out = capsys.readouterr().out
    assert " NO " not in out and "exact quantities agree" in out
    for needle in ("dp bytes sent/step (2 steps)", "tp bytes sent/step (2 steps)", "[runtime]"):
        assert needle in out


def test_validate_zero_stages_and_zb_h1_match_exactly(capsys):
    """ZeRO 1, 2, 3 at dp = 2 and ZB-H1 at pp = 2: model state itemised, bytes per step and
    the schedule's slots are deterministic, so every such row must be equal; the ZeRO rows
    carry the paper's volume with S the padded flat buffers."""
    from paratrain.bench.planner.run import run_validation

    cases = ["zero1", "zero2-full", "zero2-shard", "zero3", "zb-h1"]
    assert run_validation(steps=2, cases=cases) == 0
    out = capsys.readouterr().out
    assert " NO " not in out and "exact quantities agree" in out
    rows = {tuple(line.split()[:3]): line for line in out.splitlines() if line[:1] != " "}
    for zero in ("zero1", "zero2-full", "zero2-shard", "zero3"):
        for kind in ("params", "grads", "optimizer", "master"):
            assert rows[(zero, "0,1", kind)].split()[6] == "yes"  # the ok column
    assert "= 2 (k-1) S / k, one sync per step" in rows[("zero2-full", "0,1", "dp")]
    # accumulate shard, K = 2: one more reduce-scatter of (k-1)S/k = 1,783,296 bytes
    assert " 5,349,920 " in rows[("zero2-shard", "0,1", "dp")]
    assert "= (K + 1) (k-1) S / k" in rows[("zero2-shard", "0,1", "dp")]
    assert "= K 3 (k-1) S / k" in rows[("zero3", "0,1", "dp")]
    assert " 1,783,296 " in rows[("zero2-full", "0,1", "grads")]  # a shard: N / 2 x 4 bytes
    assert "1F1B idles 3 (S-1) = 3" in rows[("zb-h1", "all", "idle")]


def test_validate_cases_are_checked_before_any_work(capsys):
    code, out, err = run(capsys, "--validate", "--validate-cases", "dp,zz", "--no-chart")
    assert code == 2 and out == ""
    assert "validate cases zz unknown; valid: dp, tp, gpipe, 1f1b, interleaved, 3d, zero1" in err
    code, _, err = run(capsys, "--validate-cases", "dp", "--no-chart")
    assert code == 2 and "--validate-cases needs --validate" in err


def test_validate_cp_and_experts_match_exactly_but_the_routed_tokens(capsys):
    """Ring cp 2, all-to-all cp 2 under ZeRO-1 and moe-tiny at dp 2 x ep 2: model state,
    bytes per step on dp_cp, cp and dp (with the routing counts and buffers) exact; the ep
    row holds the router's tokens, predicted for a balanced router, so it is explained
    (~), not checked, and says so."""
    from paratrain.bench.planner.run import run_validation

    assert run_validation(steps=2, cases=["cp", "cp-a2a", "ep"]) == 0
    out = capsys.readouterr().out
    assert " NO " not in out
    rows = {tuple(line.split()[:3]): line for line in out.splitlines() if line[:1] != " "}
    assert "(ring) 3,145,728" in rows[("cp", "0,1", "cp")]
    assert "(all-to-all) 2,097,152" in rows[("cp-a2a", "0,1", "cp")]
    assert rows[("cp-a2a", "0,1", "dp_cp")].split()[9] == "yes"
    assert "router bias and load buffers 128" in rows[("ep", "0", "dp")]
    assert rows[("ep", "0,1", "optimizer")].split()[6] == "yes"  # dense + expert shares
    ep = rows[("ep", "0,1", "ep")]
    assert ep.split()[9] == "~" and "[routed: a balanced router]" in ep
