"""The planner's context parallelism and mixture of experts, on hand-computed cases.

Pure: no process starts. The planner's cp bytes are `plan/context_cost.py`'s
formulas (which tests/test_context_parallel.py holds to the ledger) for one tp rank; its
MoE all-to-all bytes at imbalance 1 are `plan/expert_cost.py`'s expected
bytes; Mixtral 8x7B's counts are checked against its published 46.7B total and 12.9B
active parameters at their published precision (0.1B), and exactly against a hand count.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from paratrain.cli import main
from paratrain.plan import context, moe
from paratrain.plan.cluster import cluster_preset, cluster_with
from paratrain.plan.context_cost import ring_bytes, ulysses_bytes
from paratrain.plan.estimate import estimate
from paratrain.plan.expert_cost import expected_token_bytes
from paratrain.plan.layout import PRECISIONS, Layout, Workload
from paratrain.plan.model import ModelSpec, model_preset
from paratrain.plan.time import llama_flops_per_token, model_training_flops

A100 = cluster_preset("a100-80gb-nvlink300-ib25")
FP32 = Workload(micro_batch=2, global_batch=2, precision=PRECISIONS["fp32"])
# One Llama layer: 8 heads of dimension 8, 4 key/value heads, 64 tokens.
ONE = ModelSpec("one", None, 1, 64, 8, 256, 64, arch="llama", n_kv_head=4, ffn_hidden=128)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_cp_traffic_is_the_cost_formulas_per_tp_rank(cp):
    b, s, d, e = 2, 64, 8, 4
    for tp in (1, 2):
        lay = Layout(cp=cp, tp=tp, dp=1)
        (ring,) = context.cp_traffic(ONE, FP32, lay, A100, 1)
        both = ring_bytes(b, s, 4, d, e, cp) + ring_bytes(b, s, 4, d, e, cp, backward=True)
        assert ring.bytes * tp == both and ring.messages == 3 * (cp - 1)
        a2a = replace(lay, cp_method="alltoall")
        (entry,) = context.cp_traffic(ONE, FP32, a2a, A100, 1)
        assert entry.bytes * tp == 2 * ulysses_bytes(b, s, 8, 4, d, e, cp)
        assert entry.messages == 2 * 2 * (cp - 1)
    full = replace(FP32, recompute="full")  # the forward ring runs again
    (ring,) = context.cp_traffic(ONE, full, Layout(cp=cp), A100, 1)
    assert ring.bytes == 2 * ring_bytes(b, s, 4, d, e, cp) + ring_bytes(b, s, 4, d, e, cp, True)


def test_ring_hides_behind_the_block_until_the_block_is_shorter():
    # One hop of 2 b (s/c) h_kv d e = 2*2*32*4*8*4 = 16384 bytes at 1 byte/s: 16384 s; the
    # forward block 2 b s^2 h / c^2 = 2*2*64*64*64/4 = 262144 FLOPs at 1 FLOP/s.
    lay = Layout(cp=2)
    slow = cluster_with(A100, intra_bw=1.0, intra_latency_s=0.0, peak_flops=1.0, utilisation=1.0)
    assert context.ring_block_s(ONE, FP32, lay, slow) == 262144
    # Forward hides the hop (16384 < 262144); backward 2 hops behind 2.5 blocks: all of it.
    assert context.ring_hidden_s(ONE, FP32, lay, slow, 1) == 3 * 16384
    fast_compute = replace(slow, peak_flops=100.0)  # block 2621.44 s: shorter than a hop
    hidden = context.ring_hidden_s(ONE, FP32, lay, fast_compute, 1)
    assert hidden == pytest.approx(2621.44 + 2.5 * 2621.44)
    est = estimate(ONE, replace(fast_compute, gpus=2), FP32, lay)
    ring_s = 3 * 16384
    # The gradients are all-reduced over dp_cp, the 2 cp ranks here, none of it overlapped.
    (grads,) = [c for c in est.comm if c.axis == "dp"]
    assert grads.bytes == 2 * (2 - 1) * ONE.params * 4 // 2
    assert est.time.exposed_comm_s == pytest.approx(ring_s - hidden + grads.bytes)
    a2a = estimate(ONE, replace(fast_compute, gpus=2), FP32, replace(lay, cp_method="alltoall"))
    assert a2a.time.exposed_comm_s == pytest.approx(a2a.time.comm_s)  # nothing hides


def test_cp_divides_activations_and_not_the_model_state():
    big = model_preset("llama3-8b")
    w = Workload(micro_batch=1, global_batch=8)
    cluster = cluster_with(A100, gpus=8)
    base = estimate(big, cluster, w, Layout(dp=8))
    for cp in (2, 4, 8):
        lay = Layout(dp=8 // cp, cp=cp)
        est = estimate(big, cluster, w, lay)
        buffer = context.ring_buffer_bytes(big, w, lay)
        assert buffer == 2 * 2 * (8192 // cp) * 8 * 128 * 2  # two k, v chunks in flight
        assert est.activation_bytes == pytest.approx(base.activation_bytes / cp + buffer)
        assert est.model_state == base.model_state  # ZeRO 0: whole on every rank
        # ZeRO shards over dp * cp, the ranks holding the same parameters.
        z1 = estimate(big, cluster, w, replace(lay, zero=1))
        assert z1.model_state == estimate(big, cluster, w, Layout(dp=8, zero=1)).model_state


def test_cp_refusals_name_the_numbers():
    lay = Layout(cp=8, tp=1, cp_method="alltoall")
    assert "does not divide 8 heads and 4 key/value heads" in context.cp_problems(ONE, lay)[0]
    assert context.cp_problems(ONE, Layout(cp=4, cp_method="alltoall")) == []
    short = replace(ONE, seq_len=12)
    assert "does not split into 2 x cp 4" in context.cp_problems(short, Layout(cp=4))[0]


def test_mixtral_counts_match_the_published_figures():
    m = model_preset("mixtral-8x7b")
    # Published to one decimal of a billion: equal at that precision (within 0.4%).
    assert m.params == 46_702_792_704 and round(m.params / 1e9, 1) == 46.7
    assert m.active_params == 12_879_925_248 and round(m.active_params / 1e9, 1) == 12.9
    # By hand: per layer 8 experts of 3 x 4096 x 14336, a router 4096 x 8.
    assert moe.all_expert_params(m) == 32 * 8 * 3 * 4096 * 14336
    assert m.params - m.active_params == 32 * 6 * 3 * 4096 * 14336  # 6 idle experts


def test_mixtral_flops_come_from_the_active_parameters():
    m = model_preset("mixtral-8x7b")
    h, s, n_layer, vocab = 4096, 32768, 32, 32000
    per_token = model_training_flops(m, 1.0)
    matrices = m.active_params - vocab * h - n_layer * 2 * h - h  # no table, no norms
    assert per_token == 6 * matrices + 12 * n_layer * s * h
    # The busiest rank at imbalance 1.5 runs 1.5 x the routed experts' FLOPs.
    busy = model_training_flops(m, 1.0, imbalance=1.5)
    assert busy - per_token == pytest.approx(6 * n_layer * 0.5 * 2 * 3 * h * 14336)
    capped = replace(m, capacity_factor=1.25)
    assert model_training_flops(capped, 1.0, imbalance=1.5) == pytest.approx(
        per_token + 6 * n_layer * 0.25 * 2 * 3 * h * 14336
    )
    assert llama_flops_per_token(moe.dense_equivalent(m)) == per_token - 6 * n_layer * h * 8


def test_expert_memory_and_all_to_all_bytes_per_rank():
    m = model_preset("mixtral-8x7b")
    experts = moe.all_expert_params(m)
    cluster = cluster_with(A100, gpus=8)
    w = Workload(micro_batch=1, global_batch=8)
    dense_state = estimate(m, cluster, w, Layout(dp=8)).model_state.total
    for ep in (2, 4, 8):
        state = estimate(m, cluster, w, Layout(dp=8, ep=ep)).model_state.total
        assert dense_state - state == 16 * experts * (ep - 1) // ep  # 16 bytes a parameter
        assert moe.expert_bytes_per_rank(m, 1, 1, ep, 2) == 2 * experts / ep
    tokens, e = 4096, 2
    for ep in (2, 4, 8):
        uniform = moe.all_to_all_bytes(m, tokens, ep, 1, e, 1.0)
        assert uniform == expected_token_bytes(tokens, 2, ep, 4096, e)
        skewed = moe.all_to_all_bytes(m, tokens, ep, 1, e, 2.0)
        assert skewed == pytest.approx(uniform * 3 / 2)  # (1 + iota) / 2
    capped = replace(m, capacity_factor=1.25)
    assert moe.all_to_all_bytes(capped, tokens, 2, 1, e, 3.0) == pytest.approx(
        moe.all_to_all_bytes(m, tokens, 2, 1, e, 1.25)
    )
    # In the estimate: per MoE layer and micro-batch, forward and backward.
    est = estimate(m, cluster, w, Layout(dp=8, ep=4))  # expert_dp: 2 ranks
    (counts,) = [c for c in est.comm if c.what == "expert counts"]
    (tokens_entry,) = [c for c in est.comm if c.what == "tokens to experts and back"]
    per_pass = expected_token_bytes(32768, 2, 4, 4096, 2)
    assert tokens_entry.bytes == round(1 * 32 * 2 * per_pass)
    assert counts.bytes == 32 * 3 * 2 * 8  # (ep - 1) x E/ep int64 per layer, forward
    assert {c.axis for c in est.comm} == {"dp", "expert_dp", "ep"}


def test_plan_flags_for_cp_and_experts(capsys):
    def run(*argv: str) -> tuple[int, str]:
        code = main(["plan", "--no-chart", *argv])
        out = capsys.readouterr()
        return code, out.out + out.err

    code, out = run(
        "--preset", "llama3-8b", "--seq-len", "65536", "--cp", "8", "--dp", "1", "--all"
    )  # fmt: skip
    assert code == 0 and "tp1.cp8.pp1.dp1.z0" in out
    code, out = run("--preset", "mixtral-8x7b", "--gpus", "64", "--ep", "8", "--tp", "8")
    assert code == 0 and ".ep8" in out
    code, out = run("--params", "7e9", "--cp", "2", "--dp", "4")  # no shape: rejected, why
    assert code == 0 and "context-parallel traffic needs the model's shape" in out
    for argv, message in [
        (("--cp", "3"), "no layout with cp=3 on 8 GPUs"),
        (("--preset", "7b", "--ep", "2"), "--ep 2 needs a mixture of experts"),
        (("--preset", "mixtral-8x7b", "--moe-imbalance", "0.5"), "MoE imbalance 0.5"),
        (("--preset", "mixtral-8x7b", "--top-k", "9"), "top-k 9; valid: 1 to 8"),
        (("--experts", "4", "--preset", "7b"), "counted for the llama architecture"),
        (("--preset", "7b", "--moe-imbalance", "2"), "--moe-imbalance needs a mixture"),
        (("--preset", "7b", "--top-k", "1"), "--top-k needs a mixture of experts"),
    ]:
        code, out = run(*argv)
        assert code == 2 and message in out and "Traceback" not in out, (argv, out)


def test_the_docs_cp_versus_tp_table_is_what_the_planner_computes():
    from scripts import cp_vs_tp_table as table

    doc = table.DOC.read_text()
    assert table.with_table(doc) == doc, (
        "docs/planner.md's cp-vs-tp table is stale: run scripts/cp_vs_tp_table.py --write"
    )
