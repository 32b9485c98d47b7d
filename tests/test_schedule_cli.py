"""`paratrain schedule`: the grid, the bubble against the formula, the JSON line, errors.

In-process through `paratrain.cli.main`; the simulation is pure, so nothing starts.
"""

from __future__ import annotations

import json

import pytest

from paratrain.cli import main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["schedule", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_1f1b_grid_bubble_and_peak(capsys):
    code, out, _ = run(
        capsys, "--schedule", "1f1b", "--stages", "4", "--microbatches", "8", "--json"
    )
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("stage 0 |F0 F1 F2 F3")
    assert lines[3].startswith("stage 3 |.  .  .  F0 B0 F1 B1")
    assert "formula (S-1)/(K+S-1) = 0.2727" in out
    data = last_json(out)
    assert data["bubble_fraction"] == pytest.approx(3 / 11)
    assert data["bubble_per_stage"] == pytest.approx([3 / 11] * 4)
    assert data["bubble_formula"] == pytest.approx(3 / 11)
    assert data["peak_in_flight"] == [4, 3, 2, 1]
    assert (data["schedule"], data["stages"], data["microbatches"], data["chunks"]) == (
        "1f1b",
        4,
        8,
        1,
    )


@pytest.mark.parametrize(
    ("argv", "bubble", "peak"),
    [
        (["--schedule", "gpipe", "--pp", "4", "--microbatches", "4"], 3 / 7, [4, 4, 4, 4]),
        # Interleaved defaults to v = 2: (S-1)/(vK+S-1).
        (["--schedule", "interleaved", "--stages", "4", "--microbatches", "8"], 3 / 19, None),
        (
            ["--schedule", "interleaved", "--stages", "2", "--microbatches", "4", "--chunks", "3"],
            1 / 13,
            None,
        ),
        # backward = 2 x forward: GPipe's fraction does not change, ZB-H1's is (S-1)/(3K+S-1).
        (
            ["--schedule", "gpipe", "--stages", "4", "--microbatches", "8", "--backward-cost", "2"],
            3 / 11,
            None,
        ),
        (
            ["--schedule", "zb-h1", "--stages", "4", "--microbatches", "8", "--backward-cost", "2"],
            3 / 27,
            [4, 4, 4, 4],
        ),
    ],
)
def test_bubble_matches_the_formula(capsys, argv, bubble, peak):
    code, out, _ = run(capsys, *argv, "--json")
    assert code == 0
    data = last_json(out)
    assert data["bubble_fraction"] == pytest.approx(bubble)
    assert data["bubble_formula"] == pytest.approx(bubble)
    if peak is not None:
        assert data["peak_in_flight"] == peak


def test_png_and_chrome_trace_are_written(capsys, tmp_path):
    png, trace = tmp_path / "g.png", tmp_path / "t.json"
    code, out, _ = run(
        capsys,
        "--schedule",
        "zb-h1",
        "--stages",
        "2",
        "--microbatches",
        "4",
        "--out",
        str(png),
        "--trace",
        str(trace),
        "--json",
    )
    assert code == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["name"] for e in events if e["ph"] == "X"} >= {"F0", "BI0", "BW3"}
    data = last_json(out)
    assert (data["out"], data["trace"]) == (str(png), str(trace))


def test_no_json_line_without_the_flag(capsys):
    code, out, _ = run(capsys, "--schedule", "gpipe", "--stages", "2", "--microbatches", "2")
    assert code == 0
    assert not out.strip().splitlines()[-1].startswith("{")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--schedule", "interleaved", "--stages", "4", "--microbatches", "6"],
            "--microbatches 6 is not a multiple of --stages 4",
        ),
        (["--schedule", "1f1b", "--stages", "2", "--chunks", "2"], "--chunks 2; valid: 1"),
        (["--schedule", "gpipe", "--stages", "0"], "--schedule gpipe: --stages 0"),
        (["--schedule", "gpipe", "--backward-cost", "0"], "--backward-cost 0.0; valid: > 0"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and message in err
    assert err.startswith("paratrain schedule: error:")


def test_unknown_schedule_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["schedule", "--schedule", "pipedream"])
    assert exc.value.code == 2
    assert "invalid choice: 'pipedream'" in capsys.readouterr().err
