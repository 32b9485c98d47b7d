"""`paratrain bench comm`: flags, cost models and fit (pure), then one tiny real sweep.

The real sweep runs 2 ranks on two small sizes, one of them not divisible by 2 elements,
so the remainder chunk is exercised: every ring and tree measurement must have sent
exactly what `paratrain.comm.traffic` says, rank by rank. No timing is asserted.
"""

from __future__ import annotations

import json
import math

import pytest

from paratrain import cli
from paratrain.bench.comm import calls
from paratrain.bench.comm.fit import (
    busbw_factor,
    cost,
    expected_sent,
    fit_alpha_beta,
    shared_fit,
    tree_vs_ring,
)
from paratrain.bench.comm.run import combine, run_comm_bench
from paratrain.bench.comm.sweep import DEFAULT_SIZES, DEFAULT_SIZES_FLAG, Sweep, parse_size
from tests.test_cli_main import refused

RESULT_KEYS = {
    "op",
    "algo",
    "world_size",
    "bytes",
    "time_s",
    "sent_bytes_per_rank",
    "expected_sent_bytes_per_rank",
    "algbw_gbps",
    "busbw_gbps",
    "oversubscribed",
}


def test_sizes_parse_in_binary_units():
    assert parse_size("1KB") == 1024
    assert parse_size("64MB") == 64 * 2**20
    assert parse_size("4k") == parse_size("4KiB") == 4096
    assert parse_size("1028") == 1028
    assert tuple(parse_size(s) for s in DEFAULT_SIZES_FLAG.split(",")) == DEFAULT_SIZES


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--sizes", "12XB"),
        ("--sizes", "6B"),
        ("--ops", "all_to_one"),
        ("--algos", "butterfly"),
        ("--world-sizes", "1"),
        ("--world-sizes", "two"),
        ("--repeats", "0"),
    ],
)
def test_bad_flags_exit_2_naming_the_value(flag, value, capsys):
    err = refused(capsys, "bench", "comm", flag, value)  # the parser's or the bench's
    assert value.removesuffix("B") in err


def test_only_ops_that_have_an_algorithm_are_paired():
    sweep = Sweep(ops=("all_reduce", "broadcast", "all_gather"), algos=("ring", "tree"))
    assert sweep.pairs() == [
        ("all_reduce", "ring"),
        ("all_reduce", "tree"),
        ("broadcast", "tree"),
        ("all_gather", "ring"),
    ]


def test_cost_models_and_bus_bandwidth_factors():
    assert cost("all_reduce", "ring", 8) == cost("all_reduce", "native", 8)
    assert cost("all_reduce", "ring", 8).steps == 14 and cost("all_reduce", "tree", 8).steps == 6
    assert cost("all_reduce", "ring", 4).factor == 1.5
    assert cost("broadcast", "tree", 5).steps == 3  # ceil(log2 5)
    assert busbw_factor("all_reduce", 4) == 1.5
    assert busbw_factor("all_gather", 4) == 0.75
    assert busbw_factor("reduce", 4) == 1.0
    # all-to-all: k - 1 rounds of one chunk each way, nccl-tests' (k-1)/k bus factor
    assert cost("all_to_all", "pairwise", 4) == cost("all_to_all", "native", 4)
    assert cost("all_to_all", "pairwise", 4).steps == 3 and busbw_factor("all_to_all", 4) == 0.75


def test_expected_bytes_add_up_to_the_textbook_totals():
    k, nbytes = 4, 4 * 1001  # 1001 elements: chunks of 251, 250, 250, 250
    ring = expected_sent("all_reduce", "ring", nbytes, k)
    assert sum(ring) == 2 * (k - 1) * nbytes  # every chunk crosses k-1 links, twice
    assert expected_sent("all_reduce", "native", nbytes, k) == ring
    tree = expected_sent("all_reduce", "tree", nbytes, k)
    assert sum(tree) == 2 * (k - 1) * nbytes and tree[-1] == nbytes  # a leaf sends once
    # binomial tree on 4: 0 -> 1, 0 -> 2, 2 -> 3
    assert expected_sent("broadcast", "tree", nbytes, k) == [2 * nbytes, 0, nbytes, 0]
    # all-to-all: every chunk but the rank's own (chunk 0 is one element longer)
    a2a = expected_sent("all_to_all", "pairwise", nbytes, k)
    assert a2a == [nbytes - 4 * 251] + [nbytes - 4 * 250] * 3
    assert expected_sent("all_to_all", "native", nbytes, k) == a2a


def test_fit_recovers_alpha_and_beta_and_the_crossover():
    alpha, beta = 50e-6, 1 / 2e9
    points = [(2, n, 2 * alpha + n * beta) for n in (1024, 2**16, 2**20, 2**24)]
    fit = fit_alpha_beta("all_reduce", "ring", points, oversubscribed=False)
    assert math.isclose(fit.alpha_s, alpha, rel_tol=1e-6)
    assert math.isclose(fit.beta_s_per_byte, beta, rel_tol=1e-6)
    tree = shared_fit(fit, "tree")
    assert tree_vs_ring(fit, tree, 2)["tree_faster"] == "never"  # 2 steps each, more bytes
    # k = 4: tree 4 a + 4 S b, ring 6 a + 1.5 S b: tree faster below S = 2 a / (2.5 b)
    at4 = tree_vs_ring(fit, tree, 4)
    assert at4["tree_faster"] == "below"
    assert math.isclose(at4["crossover_bytes"], 2 * alpha / (2.5 * beta), rel_tol=1e-9)


def _fake_rank(sent: int, wire: int | None = None) -> list[dict]:
    """A rank's canned measurement; on the wire, the ledger's bytes and 12 gloo preambles."""
    return [
        {
            "op": "all_reduce",
            "algo": "ring",
            "bytes": 1024,
            "times": [1e-3, 2e-3, 3e-3],
            "inner": 4,
            "sent": sent,
            "messages": 2,
            "wire": sent + 576 if wire is None else wire,
            "wire_headers": 52,
        }
    ]


def test_a_ring_that_sends_other_bytes_fails_the_bench(monkeypatch):
    """The rank processes are replaced by canned measurements: 2 (k-1)/k * 1024 = 1024."""
    monkeypatch.setattr(calls, "run_world", lambda sweep, world: [_fake_rank(1024)] * 2)
    sweep = Sweep(ops=("all_reduce",), algos=("ring",), world_sizes=(2,), sizes=(1024,))
    result, status = run_comm_bench(sweep, out=None)
    assert status == 0 and result["results"][0]["time_s"] == 2e-3
    monkeypatch.setattr(calls, "run_world", lambda sweep, world: [_fake_rank(1000)] * 2)
    result, status = run_comm_bench(sweep, out=None)
    assert status == 1 and result["bytes_mismatches"] == 1


def test_oversubscribed_worlds_are_marked():
    rows = combine([_fake_rank(1536)] * 4, world=4, cores=2)  # 2 (k-1) / k * 1024
    assert rows[0]["oversubscribed"] and rows[0]["bytes_match"]


def test_tiny_sweep_counts_every_byte(tmp_path, capsys):
    """Real processes, 2 ranks, every (op, algo) pair, 1 KB and 1028 B (257 elements)."""
    png = tmp_path / "comm.png"
    argv = ["bench", "comm", "--world-sizes", "2", "--sizes", "1KB,1028B", "--repeats", "2"]
    assert cli.main([*argv, "--out", str(png), "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = result["results"]
    assert len(rows) == 2 * 13  # 13 (op, algo) pairs, 2 sizes
    for r in rows:
        assert RESULT_KEYS <= set(r)
        assert r["world_size"] == 2 and not r["oversubscribed"] and r["time_s"] > 0
        assert r["sent_bytes_per_rank"] == r["expected_sent_bytes_per_rank"], r
    assert {(r["op"], r["algo"]) for r in rows if r["algo"] == "tree"} == {
        ("all_reduce", "tree"),
        ("broadcast", "tree"),
        ("reduce", "tree"),
    }
    assert {(r["op"], r["algo"]) for r in rows if r["op"] == "all_to_all"} == {
        ("all_to_all", "native"),
        ("all_to_all", "pairwise"),
    }
    assert {f["algo"] for f in result["fits"]} == {"native", "ring", "tree", "pairwise"}
    assert png.stat().st_size > 0
