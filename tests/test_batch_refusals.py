"""A batch the layout cannot take is refused in the flags' words with values that work
(issue 30): K, the micro-batches per step, is no flag, so the refusal names --global-batch,
--micro-batch and dp, and each value it suggests is then accepted."""

from __future__ import annotations

import re

import pytest

from paratrain.cli import main

INTERLEAVED = ["--nproc", "8", "--dp", "2", "--pp", "2", "--tp", "2"]
INTERLEAVED += ["--schedule", "interleaved", "--chunks", "2"]
MOE = ["--model", "moe-tiny", "--nproc", "4", "--ep", "2", "--zero", "1"]


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (INTERLEAVED, "K = --global-batch / (--micro-batch * dp) = 16 / (8 * 2) = 1"),
        (MOE, "--global-batch 16 is not divisible by --micro-batch * dp = 8 * 4 = 32"),
    ],
)
def test_refusal_names_flags_and_its_suggestions_work(capsys, argv, said):
    assert main(["train", *argv, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert said in err and "num_microbatches" not in err and "num_stages" not in err
    fixes = re.findall(r"(--(?:micro|global)-batch) (\d+)", err.split("; use ")[-1])
    assert {flag for flag, _ in fixes} == {"--micro-batch", "--global-batch"}
    for flag, value in fixes:
        assert main(["train", *argv, flag, value, "--dry-run"]) == 0, (flag, value)
        capsys.readouterr()
