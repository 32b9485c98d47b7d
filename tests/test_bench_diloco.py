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
    gradient across the groups every step, DiLoCo the pseudo-gradient every other step;
    int8 with error feedback and int8 outer gradients a quarter of each; PowerSGD at rank
    4, in one group whose dp also carries the first step's broadcast of the parameters (a
    quarter of the model per step over 4 steps), under half of data parallelism's."""
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
    assert every_step / row["dp int8"]["sent_per_step"] >= 3.9
    assert every_step / row["dp powersgd"]["sent_per_step"] >= 2
    assert all(row[way]["median_s"] > 0 for way in row if isinstance(row[way], dict))


def test_one_link_given_by_its_flags_replaces_the_sweep():
    from paratrain.bench.diloco.run import one_link

    assert one_link(None, None) is None  # the sweep
    assert one_link(2e-3, 1.25e8) == [(2e-3, 1.25e8)]  # 1 Gbit/s
    assert one_link(None, 1.25e8) == [(0.0, 1.25e8)]  # no latency


@pytest.mark.parametrize(
    "flag",
    [["--steps", "0"], ["--sync-every", "0"], ["--pairs", "1"], ["--link-latency", "-1"],
     ["--link-bandwidth", "-5"]],
)  # fmt: skip
def test_bad_flags_are_refused_in_one_line(flag, capsys):
    assert flag[0] in refused(capsys, "bench", "diloco", *flag)


def test_slow_links_trains_every_way_on_the_same_tokens_and_counts_the_bytes_across():
    """4 steps of the tiny model in 2 groups: every way reaches a finite validation loss
    on the same held-out batches; int8 sends at least 3.9 and sign 20 times fewer bytes
    across than HSDP, DiLoCo at H 2 about half (its two outer steps against four
    all-reduces), at H 4 a quarter; Streaming DiLoCo's two fp4 fragments 7.76 times fewer
    per synchronization, but fragment 1 synchronizes after steps 1, 3 and the last, about
    2.5 models' worth against DiLoCo's 2: over 6 times fewer."""
    import math

    from paratrain.bench.diloco.loss import run_slow_links_bench

    cfg = tiny_config()
    out = run_slow_links_bench(2, 4, 2, 4, 2, base=cfg, data=tiny_data())["ways"]
    assert all(math.isfinite(way["val"]) for way in out.values())
    sent = {name: way["sent"] for name, way in out.items()}
    dp = sent["dp (HSDP)"]
    assert dp / sent["dp int8"] >= 3.9 and dp / sent["dp sign"] >= 20
    assert sent["diloco H2"] == dp / 2 and sent["diloco H4"] == dp / 4
    assert sent["streaming fp4 H2"] < sent["diloco H2"] / 6


def test_slow_links_refuses_groups_that_cannot_share_the_batch(capsys):
    assert "--groups 3" in refused(capsys, "bench", "slow-links", "--groups", "3")
