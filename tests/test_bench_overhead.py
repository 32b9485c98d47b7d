"""`paratrain bench overhead --peer transformers`: our step against a plain loop over
transformers' model holding our weights. No timing is asserted: a tiny real run through
the CLI, the loss check that voids a comparison, and the combination it refuses."""

from __future__ import annotations

import json

import torch

from paratrain.bench.overhead import run as overhead_bench
from paratrain.bench.overhead.profile import op_differences
from paratrain.cli import main
from paratrain.train.build import build_model
from tests.equivalence import tiny_config

TINY = ["--steps", "2", "--rounds", "2"]


def test_the_plain_loop_can_train_transformers_model(capsys):
    assert main(["bench", "overhead", *TINY, "--peer", "transformers", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "GPT2LMHeadModel" in result["peer"] and "attn_implementation=sdpa" in result["peer"]
    assert result["steps"] == 4 and result["ratio"] > 0


def test_a_twin_with_a_misplaced_weight_fails_the_losses_check(capsys, monkeypatch):
    real = overhead_bench.transformers_twin

    def swapped_bias(model_cfg, ours):
        peer, line = real(model_cfg, ours)
        mlp = peer.hf.transformer.h[0].mlp
        with torch.no_grad():  # a bias read from the wrong block
            mlp.c_fc.bias.copy_(peer.hf.transformer.h[1].mlp.c_fc.bias.add(0.1))
        return peer, line

    monkeypatch.setattr(overhead_bench, "transformers_twin", swapped_bias)
    assert main(["bench", "overhead", *TINY, "--peer", "transformers"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "losses differ at step 0" in err[0], err


def test_transformers_peer_with_compile_is_refused(capsys):
    assert main(["bench", "overhead", *TINY, "--peer", "transformers", "--compile"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--peer transformers with --compile" in err[0], err


def test_profile_counts_the_ops_of_each_loop(monkeypatch):
    """The profile counts each loop's ops per step: a second pass over the gradients shows
    as one more multiply per gradient tensor a step (`aten::mul_` per tensor, and
    `aten::mul` under it where the factor is a number). A tiny GPT: the suite's time."""
    from paratrain.train.engine import Engine

    cfg = tiny_config()
    cfg.train.microbatches = cfg.train.global_batch // cfg.train.micro_batch

    def muls() -> dict[str, float]:
        ours, plain, _ = overhead_bench._loops(cfg, total=3, peer="plain")
        ours(0), plain(0)  # warm: the optimizers' state exists
        rows = op_differences(ours, plain, range(1, 3))
        return {
            str(r["op"]): float(r["ours_calls"])
            for r in rows
            if str(r["op"]).startswith("aten::mul")
        }

    one_pass = muls()
    settle = Engine.settle_grads

    def two_passes(self, factor=1.0):  # the step before it folded 1 / tokens into the clip
        settle(self, 1.0)
        for r in self.replicas:
            r.scale_grads_(factor * 1.000001)

    monkeypatch.setattr(Engine, "settle_grads", two_passes)
    more = {op: n - one_pass.get(op, 0.0) for op, n in muls().items()}
    tensors = len(list(build_model(cfg).parameters()))
    assert max(more.values()) == tensors, more


def test_profile_flag_gives_each_ops_counts(capsys):
    argv = ["bench", "overhead", "--steps", "1", "--rounds", "1", "--profile", "1", "--json"]
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["profile"]
    assert any(r["op"] == "aten::mm" and r["ours_calls"] == r["plain_calls"] > 0 for r in rows)


def test_a_negative_profile_is_refused(capsys):
    assert main(["bench", "overhead", *TINY, "--profile", "-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--profile -1" in err[0], err
