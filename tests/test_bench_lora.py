"""`paratrain bench lora`: a tiny real run of the paired steps and the fine-tuning curves.
No timing is asserted: what each side holds and trains is."""

from __future__ import annotations

import pytest

from paratrain.bench.lora.run import run_lora_bench
from tests.equivalence import tiny_config, tiny_data
from tests.test_cli_main import refused


def test_lora_holds_and_steps_only_its_adapters_and_both_curves_start_from_one_base():
    cfg = tiny_config(seq_len=64)  # lines of up to 32 bytes, each pair a row
    cfg.model.max_seq_len = 64
    result = run_lora_bench(pairs=4, rank=2, steps=4, base_steps=4, every=2, base=cfg,
                            data=tiny_data())  # fmt: skip
    for zero in (0, 3):
        summary = result[f"zero{zero}"]
        assert summary["pairs"] == 4 and summary["ratio"] > 0
        lora, full = summary["state"]["lora"], summary["state"]["full"]
        assert full["grads"] == full["params"] and full["optimizer"] == 2 * full["params"]
        assert lora["optimizer"] == 2 * lora["grads"]  # AdamW's two moments, adapters only
        assert lora["params"] == full["params"] + lora["grads"]  # the base and the adapters
    curves = result["curve"]["curves"]
    assert [s for s, _ in curves["lora"]] == [0, 2, 4] == [s for s, _ in curves["full"]]
    assert curves["lora"][0] == curves["full"][0] and curves["lora"] != curves["full"]
    assert result["curve"]["documents"] > 0


@pytest.mark.parametrize(
    "flag", [["--steps", "0"], ["--rank", "0"], ["--pairs", "3"], ["--lora-lr-scale", "0"]]
)
def test_bad_flags_are_refused_in_one_line(flag, capsys):
    assert flag[0] in refused(capsys, "bench", "lora", *flag)
