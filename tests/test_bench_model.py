"""`paratrain bench model`: our GPT and Llama against transformers' twins. No timing is
asserted: a tiny real run through the CLI, and the check that voids a comparison (a
weight in the wrong place in the twin fails the float64 agreement)."""

from __future__ import annotations

import json

import pytest
import torch

from paratrain.bench.model import run as model_bench
from paratrain.cli import main

SMALL = ["--seq-len", "16", "--batch", "2", "--pairs", "4"]


def test_bench_model_runs_both_twins_and_reports_the_machine(capsys):
    assert main(["bench", "model", *SMALL, "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [m["model"] for m in result["models"]] == ["gpt-tiny", "llama-tiny"]
    for m in result["models"]:
        assert m["float64_relative"] <= model_bench.rounding_bound(
            model_bench.bench_config(m["model"], 16, 2).model, 16, model_bench.FLOAT64_UNIT
        )
        assert "attn_implementation=sdpa" in m["peer"]
        for mode in ("fwd-bwd", "step"):
            assert m[mode]["pairs"] == 4 and m[mode]["ratio"] > 0
    assert result["machine"]["cpu"] and result["machine"]["torch"] == torch.__version__


def test_a_misplaced_weight_in_the_twin_fails_the_bench(monkeypatch):
    real = model_bench.transformers_twin

    def swapped_bias(model_cfg, ours):
        peer, line = real(model_cfg, ours)
        mlp = peer.hf.transformer.h[0].mlp
        with torch.no_grad():  # a bias read from the wrong block
            mlp.c_fc.bias.copy_(peer.hf.transformer.h[1].mlp.c_fc.bias)
        return peer, line

    monkeypatch.setattr(model_bench, "transformers_twin", swapped_bias)
    with pytest.raises(RuntimeError, match="float64 losses"):
        model_bench.bench_one("gpt-tiny", 4, 16, 2, ["fwd-bwd"])


@pytest.mark.parametrize(
    "flags, named",
    [(["--what", "fwd"], "--what 'fwd'"), (["--models", "moe-tiny"], "--models 'moe-tiny'")],
)
def test_bench_model_refuses_what_it_cannot_compare(capsys, flags, named):
    assert main(["bench", "model", *SMALL, *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0]
