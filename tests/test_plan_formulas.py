"""The planner's closed forms: the seeds' worked examples to the digit, then properties.

Every expected number below is the seeds' own (files in /work/shared/seeds): example
9.2.3 (7B memory table), self-test Q2 (13B), example 9.2.2 (ring volume and 6NT),
example 9.2.1 (K = 32) and section 5.1 (the 27% bubble). GB is 1e9 bytes, as they count.
"""

from __future__ import annotations

import math
import random

import pytest

from paratrain.plan import activations, comm, memory, pipeline
from paratrain.plan import time as ptime
from paratrain.plan.cluster import CLUSTER_PRESETS, GB, cluster_preset
from paratrain.plan.estimate import estimate
from paratrain.plan.layout import PRECISIONS, Layout, Workload, microbatches_for
from paratrain.plan.model import MODEL_PRESETS, ModelSpec, gpt_param_count, model_preset
from paratrain.plan.report import zero2_note

MIXED = Workload()  # mixed-precision Adam, 16 bytes per parameter; ZeRO-2 accumulates shard
FULL = Workload(zero2_accumulate="full")  # ZeRO-2 holding the whole gradient over K
SEEDS = cluster_preset("seeds-80gb-nvlink300-ib50-1e14")


def state_gb(n: float, k: int, zero: int) -> dict[str, float]:
    """The seeds' items (no accumulation: K = 1, so ZeRO-2 holds no whole gradient)."""
    s = memory.model_state_bytes(int(n), MIXED, Layout(dp=k, zero=zero)).as_dict()
    assert s.pop("grad_accumulation") == 0
    return {name: v / GB for name, v in s.items()}


def test_seeds_7b_on_8_gpus_memory_table_itemised():
    # Example 9.2.3: params, grads, optimizer (m + v), master, total, in GB.
    assert state_gb(7e9, 8, 0) == {
        "params": 14,
        "grads": 14,
        "optimizer": 56,
        "master": 28,
        "total": 112,
    }
    assert state_gb(7e9, 8, 1) == {
        "params": 14,
        "grads": 14,
        "optimizer": 7,
        "master": 3.5,
        "total": 38.5,
    }
    assert state_gb(7e9, 8, 2) == {
        "params": 14,
        "grads": 1.75,
        "optimizer": 7,
        "master": 3.5,
        "total": 26.25,
    }
    assert state_gb(7e9, 8, 3) == {
        "params": 1.75,
        "grads": 1.75,
        "optimizer": 7,
        "master": 3.5,
        "total": 14,
    }


def test_seeds_13b_q2_totals_and_items():
    assert state_gb(13e9, 8, 0)["total"] == 208
    z1 = state_gb(13e9, 8, 1)
    assert z1 == {"params": 26, "grads": 26, "optimizer": 13, "master": 6.5, "total": 71.5}
    assert state_gb(13e9, 8, 3)["total"] == 26


def test_seeds_7b_ring_all_reduce_volume_and_time():
    grads = 2 * 7 * 10**9  # bf16 gradients: S = 2N = 14 GB
    volume = comm.all_reduce_bytes(grads, 8)
    assert volume == 24.5e9
    # "All across nodes", latency ignored: 24.5 GB / 50 GB/s = 0.49 s.
    assert ptime.message_time(volume, 0, SEEDS.inter_bw, 0.0) == pytest.approx(0.49)
    # The planner's own DP entry for the same job says the same.
    (entry,) = comm.dp_traffic(model_preset("7b"), MIXED, Layout(dp=8), SEEDS, 1)
    assert (entry.op, entry.bytes, entry.link) == ("all_reduce", 24_500_000_000, "intra")


def test_seeds_7b_compute_6nt():
    tokens = 1024 * 1024  # 1024 sequences of 1024 tokens per GPU
    flops = ptime.training_flops(7 * 10**9, tokens)
    assert flops == pytest.approx(4.4e16, rel=0.01)  # the seeds round 4.404e16
    assert ptime.compute_time(flops, 1, SEEDS) == pytest.approx(440, rel=0.01)
    # "64 sequences per card": 16 times fewer tokens, about 27 s.
    assert ptime.compute_time(flops / 16, 1, SEEDS) == pytest.approx(27.5, rel=0.01)


def test_seeds_gradient_accumulation_k32():
    w = Workload(micro_batch=2, global_batch=256)
    assert microbatches_for(w, Layout(dp=4)) == 32
    with pytest.raises(ValueError, match="not divisible"):
        microbatches_for(Workload(micro_batch=3, global_batch=256), Layout(dp=4))


def test_seeds_4_stage_8_microbatch_bubble():
    assert pipeline.bubble_fraction(4, 8) == 3 / 11
    assert round(pipeline.bubble_fraction(4, 8), 2) == 0.27
    # Interleaving with v chunks: (S-1)/(vK+S-1) (Narayanan et al. 2021).
    assert pipeline.bubble_fraction(4, 8, chunks=2) == 3 / 19
    # Seeds FAQ Q13: K >= 4S keeps the bubble under 20%.
    for s in range(2, 40):
        assert pipeline.bubble_fraction(s, 4 * s) < 0.2


def test_zero_traffic_follows_the_zero_paper_not_the_seeds():
    n, k = 10**9, 8
    model = ModelSpec("1b", n_params=n)
    totals = {
        z: sum(e.bytes for e in comm.dp_traffic(model, MIXED, Layout(dp=k, zero=z), SEEDS, 1))
        for z in range(4)
    }
    ddp = 2 * (k - 1) * 2 * n // k
    assert totals[0] == totals[1] == totals[2] == ddp  # not halved for ZeRO-2
    assert totals[3] == 3 * (k - 1) * 2 * n // k  # 1.5x DDP


def test_zero3_and_zero2_shard_traffic_grows_with_accumulation():
    model = ModelSpec("1b", n_params=10**9)
    cases = ((0, MIXED, False), (1, MIXED, False), (2, FULL, False), (2, MIXED, True))
    for zero, w, grows in (*cases, (3, MIXED, True)):
        one = sum(e.bytes for e in comm.dp_traffic(model, w, Layout(dp=4, zero=zero), SEEDS, 1))
        many = sum(e.bytes for e in comm.dp_traffic(model, w, Layout(dp=4, zero=zero), SEEDS, 8))
        assert (many > one) == grows


def test_zero2_accumulation_both_options_7b_on_8_gpus_k8():
    """docs/planner.md's worked example, by hand. 7B, mixed Adam, k = 8, K = 8: S = 2N =
    14 GB of bf16 gradients, a shard S/k = 1.75 GB, one ring reduce-scatter (k-1)S/k =
    12.25 GB, the parameter all-gather (k-1)P/k = 12.25 GB.
    full: grads 1.75 + a transient whole gradient 14 = 40.25 GB of model state at the
      peak (26.25 at the step boundary, the seeds' figure), traffic 12.25 + 12.25 = 24.5 GB;
    shard: 26.25 GB, traffic 8 x 12.25 + 12.25 = 110.25 GB, of it 98 GB gradients."""
    model, lay, k = model_preset("7b"), Layout(dp=8, zero=2), 8
    full, shard = FULL, MIXED
    s_full = memory.model_state_bytes(model.params, full, lay, k)
    s_shard = memory.model_state_bytes(model.params, shard, lay, k)
    assert (s_full.grads, s_full.grad_accumulation) == (1.75e9, 14e9)
    assert (s_full.total, s_full.step_boundary) == (40.25e9, 26.25e9)
    assert (s_shard.grads, s_shard.grad_accumulation, s_shard.total) == (1.75e9, 0, 26.25e9)
    # the peak of "full" exceeds ZeRO-1's 38.5 GB by the gradient shard it keeps beside
    z1 = memory.model_state_bytes(model.params, full, Layout(dp=8, zero=1), k)
    assert s_full.total - z1.total == s_full.grads == 1.75e9
    # K = 1: nothing is accumulated, the two options are the same
    assert memory.model_state_bytes(model.params, full, lay, 1) == s_shard

    def sent(w: Workload) -> dict[tuple[str, str], int]:
        return {(e.op, e.what): e.bytes for e in comm.dp_traffic(model, w, lay, SEEDS, k)}

    assert sent(full) == {
        ("reduce_scatter", "gradients, once per step"): 12_250_000_000,
        ("all_gather", "updated parameters"): 12_250_000_000,
    }
    assert sent(shard) == {
        ("reduce_scatter", "gradients, every micro-batch"): 98_000_000_000,
        ("all_gather", "updated parameters"): 12_250_000_000,
    }


def test_zero2_estimate_reports_the_other_option():
    """Whichever option is charged, the estimate carries the other one beside it."""
    model, lay = model_preset("7b"), Layout(dp=8, zero=2)
    for charged, other in (("full", "shard"), ("shard", "full")):
        w = Workload(microbatches=8, global_batch=None, zero2_accumulate=charged)
        e = estimate(model, SEEDS, w, lay)
        assert e.alternative is not None and e.alternative.alternative is None
        by = {charged: e, other: e.alternative}
        assert (by["full"].gradient_comm_bytes, by["shard"].gradient_comm_bytes) == (
            12_250_000_000,
            98_000_000_000,
        )
        assert by["full"].memory_bytes - by["shard"].memory_bytes == 14e9  # the whole gradient
        alt = e.as_dict()["zero2_alternative"]
        assert (e.as_dict()["zero2_accumulate"], alt["zero2_accumulate"]) == (charged, other)
        assert alt["grad_accumulation"] == (14e9 if other == "full" else 0)
        assert alt["gradient_comm_bytes_per_gpu"] == by[other].gradient_comm_bytes
        note = zero2_note(e)
        assert f"K = 8, {charged}: grads 1.75" in note and "(charged) | " + other in note
        assert "gradient traffic 12.25 GB/step" in note and "gradient traffic 98.00" in note
    one = Workload(microbatches=1, global_batch=None)
    assert estimate(model, SEEDS, one, lay).as_dict()["zero2_alternative"] is None
    with pytest.raises(ValueError, match="zero2 accumulate 'half'; valid: full, shard"):
        Workload(zero2_accumulate="half")


def test_gpt_param_count_matches_the_module():
    from paratrain.models.gpt import GPT, GPTConfig, count_parameters

    for layers, d, heads, vocab, tmax in ((2, 64, 4, 256, 32), (3, 96, 3, 300, 50)):
        real = count_parameters(GPT(GPTConfig(vocab, layers, heads, d, tmax)))
        assert gpt_param_count(layers, d, vocab, tmax) == real


def test_presets_are_named_with_their_figures():
    for name, c in CLUSTER_PRESETS.items():
        assert f"nvlink{c.intra_bw / GB:.0f}" in name and f"ib{c.inter_bw / GB:.0f}" in name
        assert f"{c.gpu_memory_bytes / GB:.0f}gb" in name
    seeds = cluster_preset("seeds-80gb-nvlink300-ib50-1e14")
    assert (seeds.intra_bw, seeds.inter_bw, seeds.effective_flops) == (300e9, 50e9, 1e14)
    assert MODEL_PRESETS["7b"].params == 7 * 10**9
    for m in MODEL_PRESETS.values():
        assert m.has_shape


def test_activations_korthikanti_counts():
    # s b h (34 + 5 a s / h) without parallelism, 2 s b h with full recomputation.
    s, b, h, a = 2048, 1, 4096, 32
    none = activations.layer_activation_bytes(s, b, h, a, 1, "none")
    assert none == s * b * h * (34 + 5 * a * s / h)
    # Selective as the runtime runs it (parallel/recompute.py), not Korthikanti's 34:
    # per token 11h 16-bit elements and a logsumexp per head (docs/planner.md).
    selective = activations.layer_activation_bytes(s, b, h, a, 1, "selective")
    assert selective == s * b * (2 * 11 * h + 4 * a)
    tp8 = activations.layer_activation_bytes(s, b, h, a, 8, "selective", sequence_parallel=True)
    assert tp8 == s * b * (2 * (h / 8 + 2 * h + h) + 4 * a / 8)
    assert activations.layer_activation_bytes(s, b, h, a, 8, "full") == 2 * s * b * h
    tp8 = activations.layer_activation_bytes(s, b, h, a, 8, "none")
    assert tp8 == s * b * h * (10 + 24 / 8 + 5 * a * s / (h * 8))


def test_in_flight_microbatches_per_schedule():
    assert activations.in_flight_microbatches(Layout(pp=1), 32) == 1
    assert activations.in_flight_microbatches(Layout(pp=4, schedule="gpipe"), 32) == 32
    assert activations.in_flight_microbatches(Layout(pp=4, schedule="1f1b"), 32) == 4
    assert activations.in_flight_microbatches(Layout(pp=4, schedule="1f1b"), 2) == 2
    inter = Layout(pp=4, schedule="interleaved", chunks=2)
    assert activations.in_flight_microbatches(inter, 32) == 4 + 3 / 2  # S + (S - 1) / v


# --- properties over random inputs (fixed seed: the same cases every run) ---------------

RNG_SEED = 20240601


def random_cases(n: int = 300):
    rng = random.Random(RNG_SEED)
    for _ in range(n):
        yield rng.randint(1, 10**12), rng.choice([1, 2, 3, 4, 5, 7, 8, 16, 64, 1000]), rng


def test_property_model_state_closed_forms():
    for n, k, _ in random_cases():
        get = {z: memory.model_state_bytes(n, MIXED, Layout(dp=k, zero=z)) for z in range(4)}
        shard = math.ceil(n / k)
        assert get[0].total == 16 * n
        assert get[1].total == 4 * n + 12 * shard  # 4N + 12N/k
        assert get[2].total == 2 * n + 14 * shard  # 2N + 14N/k
        assert get[3].total == 16 * shard  # 16N/k
        assert get[0].total >= get[1].total >= get[2].total >= get[3].total
        # Sharding loses nothing: k shards hold at least the whole, at most k-1 padding.
        assert 16 * n <= k * get[3].total < 16 * (n + k)
        assert memory.redundant_bytes(n, MIXED, Layout(dp=k)) == (k - 1) * 16 * n


def test_property_ring_volumes():
    for n, k, _ in random_cases():
        s = 2 * n
        assert comm.all_reduce_bytes(s, k) == 2 * (k - 1) * s // k
        rs = comm.reduce_scatter_bytes(s, k)
        assert abs(comm.all_reduce_bytes(s, k) - 2 * rs) <= 1
        assert comm.all_reduce_bytes(s, k) < 2 * s  # approaches 2S, never reaches it


def test_property_bubble():
    rng = random.Random(RNG_SEED)
    for _ in range(300):
        s, k, v = rng.randint(1, 64), rng.randint(1, 512), rng.randint(1, 8)
        f = pipeline.bubble_fraction(s, k, v)
        assert 0 <= f < 1
        assert f == (s - 1) / (v * k + s - 1)
        assert pipeline.bubble_fraction(s, k + 1, v) <= f  # more micro-batches, less bubble
        assert f <= pipeline.bubble_fraction(s, k)  # interleaving never hurts the bubble
        # bubble time over (busy + bubble) is the bubble fraction
        busy = rng.uniform(0.1, 100)
        idle = pipeline.bubble_time(busy, s, k, v)
        assert idle / (busy + idle) == pytest.approx(f)
        if 2 <= s:
            target = rng.uniform(0.01, 0.9)
            kk = pipeline.microbatches_for_bubble(s, target, v)
            assert pipeline.bubble_fraction(s, kk, v) <= target
            assert kk == 1 or pipeline.bubble_fraction(s, kk - 1, v) > target


def test_property_layout_memory_divides_by_tp_pp_and_traffic_is_per_axis():
    rng = random.Random(RNG_SEED)
    model = model_preset("13b")
    for _ in range(200):
        tp, pp, dp = rng.choice([1, 2, 4, 8]), rng.choice([1, 2, 4, 8]), rng.choice([1, 2, 4])
        zero = rng.randint(0, 3) if dp > 1 else 0
        sched = rng.choice(["gpipe", "1f1b"]) if pp > 1 else ""
        lay = Layout(dp=dp, tp=tp, pp=pp, zero=zero, schedule=sched)
        n_local = math.ceil(model.params / (tp * pp))
        state = memory.model_state_bytes(model.params, MIXED, lay)
        assert state == memory.model_state_bytes(n_local, MIXED, Layout(dp=dp, zero=zero))
        k = rng.randint(1, 16)
        cluster = CLUSTER_PRESETS["h100-80gb-nvlink450-ib50"]
        entries = comm.traffic(model, MIXED, lay, cluster, k)
        axes = {e.axis for e in entries}
        assert ("dp" in axes) == (dp > 1) and ("tp" in axes) == (tp > 1)
        assert ("pp" in axes) == (pp > 1)
        for e in entries:
            assert e.bytes >= 0 and e.messages >= 0
        if pp > 1:
            (send,) = [e for e in entries if e.axis == "pp"]
            act = MIXED.micro_batch * model.seq_len * model.d_model * 2
            assert send.bytes == k * (2 - (pp == 2)) * act


def test_precisions_bytes_per_param():
    assert Workload().state_bytes_per_param == 16
    assert Workload(precision=PRECISIONS["fp32"]).state_bytes_per_param == 16
    assert Workload(precision=PRECISIONS["bf16"]).state_bytes_per_param == 8
    assert Workload(optimizer="sgd").state_bytes_per_param == 8  # 2 + 2 + master 4


def test_property_zero_traffic_uses_the_padded_buffer():
    """ZeRO's flat buffer holds k ceil(n/k) elements, so each rank sends exactly
    (k-1) ceil(n/k) per reduce-scatter or all-gather: (k-1)S/k with S padded."""
    rng = random.Random(RNG_SEED)
    for _ in range(300):
        n, k, m = rng.randint(1, 10**10), rng.randint(2, 64), rng.randint(1, 16)
        model = ModelSpec("n", n_params=n)
        shard = math.ceil(n / k)
        # ZeRO-1 and ZeRO-2 accumulating the whole gradient: one reduce-scatter and one
        # all-gather; ZeRO-2 accumulating into the shard (DeepSpeed): the reduce-scatter
        # after every micro-batch; ZeRO-3: three per micro-batch
        for zero, w, calls in (
            (1, MIXED, 2),
            (2, FULL, 2),
            (2, MIXED, m + 1),
            (3, MIXED, 3 * m),
        ):
            lay = Layout(dp=k, zero=zero)
            sent = sum(e.bytes for e in comm.dp_traffic(model, w, lay, SEEDS, m))
            assert sent == calls * (k - 1) * shard * 2  # 2 bytes per element, mixed
            state = memory.model_state_bytes(n, w, lay, m)
            whole = zero == 2 and w is FULL and m > 1  # the transient whole gradient
            assert state.grad_accumulation == (2 * n if whole else 0)
            assert state.step_boundary == memory.model_state_bytes(n, w, lay).total


def test_zb_h1_bubble_is_a_third_of_1f1b_in_time():
    """Qi et al. 2023 with F = B = W: ZB-H1 idles (S-1) F against 1F1B's 3 (S-1) F, for
    K >= S; with fewer micro-batches the cool-down lacks W passes: (S-1) + (S-K)."""
    for s in range(2, 9):
        for k in range(1, 40):
            ofob = pipeline.bubble_time(1.0, s, k, 1, "1f1b")
            zb = pipeline.bubble_time(1.0, s, k, 1, "zb-h1")
            assert zb == pytest.approx(ofob / 3 * (1 + max(0, s - k) / (s - 1)))
            f = pipeline.bubble_fraction(s, k, 1, "zb-h1")
            assert zb / (1 + zb) == pytest.approx(f)
            assert f <= pipeline.bubble_fraction(s, k)
        kk = pipeline.microbatches_for_bubble(s, 0.05, schedule="zb-h1")
        assert pipeline.bubble_fraction(s, kk, 1, "zb-h1") <= 0.05
        assert kk == 1 or pipeline.bubble_fraction(s, kk - 1, 1, "zb-h1") > 0.05
    assert pipeline.bubble_fraction(4, 8, 1, "zb-h1") == 3 / 27  # the seeds' 27% -> 11%
