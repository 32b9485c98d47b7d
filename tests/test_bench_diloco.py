"""`paratrain bench diloco`: a tiny real run over a slowed link between the groups. No
timing is asserted: what each way sends across is."""

from __future__ import annotations

import pytest

from paratrain.bench.diloco.run import run_diloco_bench
from paratrain.plan.comm import ring_all_reduce_rank_bytes
from tests.equivalence import tiny_config, tiny_data
from tests.test_cli_main import refused


def test_diloco_sends_an_hth_of_data_parallelism_across_and_int8_a_quarter_of_that():
    """4 steps, H 2 (outer steps after 2 and 4): data parallelism all-reduces the float32
    gradient across the groups every step, DiLoCo the pseudo-gradient every other step."""
    from paratrain.models.registry import plain_model

    cfg = tiny_config()
    result = run_diloco_bench(pairs=2, steps=4, sync_every=2, links=[(1e-4, 1e9)], base=cfg,
                              data=tiny_data())  # fmt: skip
    [row] = result["links"]
    params = sum(p.numel() for p in plain_model(cfg.model).parameters())
    every_step = ring_all_reduce_rank_bytes(params, 4, 2, 0)
    assert row["dp (HSDP)"]["sent_per_step"] == every_step
    assert row["diloco"]["sent_per_step"] == every_step / 2
    assert row["diloco"]["sent_per_step"] / row["diloco int8"]["sent_per_step"] >= 3.9
    assert all(row[way]["median_s"] > 0 for way in ("dp (HSDP)", "diloco", "diloco int8"))


@pytest.mark.parametrize("flag", [["--steps", "0"], ["--sync-every", "0"], ["--pairs", "1"]])
def test_bad_flags_are_refused_in_one_line(flag, capsys):
    assert flag[0] in refused(capsys, "bench", "diloco", *flag)
