"""The planner's per-rank and per-stage counts against the objects the runtime uses.

Pure tests: the parameter split against the real GPT sliced by tensor parallelism and cut
into stages is in `plan --validate`; here the closed forms are checked against the model's
own count and against the pipeline schedules (the same objects the runtime executes).
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import replace

import pytest

from paratrain.parallel.pipeline import Costs, build_schedule, check_schedule
from paratrain.parallel.pipeline.schedules import SEND_B, SEND_F
from paratrain.plan import activations, comm, pipeline
from paratrain.plan.layout import PRECISIONS, Layout, Workload
from paratrain.plan.model import ModelSpec, gpt_param_count
from paratrain.plan.rank_memory import (
    accumulated_gradient_bytes,
    chunk_params,
    flat_buffers,
    held_model_state,
    padding_bytes,
    rank_model_state,
    replicated_params,
)
from paratrain.plan.rank_traffic import ONE_NODE, Coords, bytes_by_axis, rank_traffic

OURS = ModelSpec("ours", n_layer=8, d_model=64, n_head=4, vocab_size=256, seq_len=32)
FP32 = Workload(micro_batch=2, global_batch=16, precision=PRECISIONS["fp32"])
FP32_FULL = replace(FP32, zero2_accumulate="full")  # FP32's ZeRO-2 accumulates shard
PIPELINES = [
    Layout(pp=s, schedule=name, chunks=v)
    for s, (name, v) in itertools.product((2, 4), (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)))
]


@pytest.mark.parametrize(("tp", "pp", "v"), [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 4, 2), (4, 2, 1)])
def test_rank_parameters_add_up_to_the_model(tp, pp, v):
    # Each stage holds tp slices of its split parameters and one copy of the replicated ones.
    lay = Layout(tp=tp, pp=pp, schedule="interleaved" if v > 1 else "1f1b", chunks=v)
    total = 0
    for stage in range(pp):
        mine, replicated = sum(chunk_params(OURS, lay, stage)), replicated_params(OURS, lay, stage)
        total += tp * (mine - replicated) + replicated
    assert total == gpt_param_count(8, 64, 256, 32) == OURS.params


def test_rank_model_state_without_a_shape_is_the_even_split():
    counted = ModelSpec("n", n_params=1000)
    state = rank_model_state(counted, FP32, Layout(tp=2, pp=2, schedule="1f1b"))
    assert state.params == 4 * 250


@pytest.mark.parametrize("layout", PIPELINES, ids=lambda lay: lay.label)
@pytest.mark.parametrize("k", [4, 8])
def test_in_flight_and_bubble_follow_the_schedule(layout, k):
    sim = check_schedule(build_schedule(layout.schedule, layout.pp, k, layout.chunks))
    for stage in range(layout.pp):
        assert activations.in_flight_chunks(layout, k, stage) == sim.peak_in_flight[stage]
    assert pipeline.bubble_fraction(layout.pp, k, layout.chunks) == sim.bubble_fraction()


@pytest.mark.parametrize("layout", PIPELINES, ids=lambda lay: lay.label)
def test_pipeline_sends_per_stage_count_the_schedules_sends(layout):
    k = 4
    schedule = build_schedule(layout.schedule, layout.pp, k, layout.chunks)
    size = comm.activation_message_bytes(OURS, FP32)
    busiest = comm.pp_traffic(OURS, FP32, layout, ONE_NODE, k)[0].bytes
    per_stage = []
    for stage, actions in enumerate(schedule.stages):
        sends = sum(a.kind in (SEND_F, SEND_B) for a in actions)
        (entry,) = comm.pp_traffic(OURS, FP32, layout, ONE_NODE, k, stage)
        assert entry.bytes == sends * size and entry.messages == sends
        per_stage.append(entry.bytes)
    assert busiest == max(per_stage)


def test_ring_all_reduce_per_rank_matches_the_formula_and_splits_odd_sizes():
    assert comm.ring_all_reduce_rank_bytes(1000, 4, 4, 0) == comm.all_reduce_bytes(4000, 4)
    # one float64 over 2 ranks: chunks [8, 0]; each rank sends the 8 bytes once
    assert [comm.ring_all_reduce_rank_bytes(1, 8, 2, r) for r in (0, 1)] == [8, 8]
    # over 3 ranks the middle rank sends the element in both phases
    assert [comm.ring_all_reduce_rank_bytes(1, 8, 3, r) for r in (0, 1, 2)] == [8, 16, 8]


def test_rank_traffic_terms_and_bookkeeping():
    lay = Layout(dp=2, tp=2, pp=2, schedule="1f1b")
    first = rank_traffic(OURS, FP32, lay, 4, Coords(stage=0))
    last = rank_traffic(OURS, FP32, lay, 4, Coords(stage=1))
    assert not any("loss statistics" in t.what for t in first)
    assert any("loss statistics" in t.what for t in last)  # the head's stage
    runtime = bytes_by_axis(first)
    planned = bytes_by_axis(first, bookkeeping=False)
    assert runtime["dp"] - planned["dp"] == 16  # the (loss, tokens) float64 pair
    assert runtime["tp"] - planned["tp"] == 8  # one float64 of gradient-norm squares
    assert runtime["pp"] - planned["pp"] == 8  # the norm sum; stage 0 ends the loss broadcast
    extra = bytes_by_axis(last)["pp"] - bytes_by_axis(last, bookkeeping=False)["pp"]
    assert extra == 8 + 4  # the norm sum, and the loss broadcast's root sends 4 bytes
    zero = rank_traffic(OURS, FP32, Layout(dp=2, zero=1), 4, Coords())
    extra = bytes_by_axis(zero)["dp"] - bytes_by_axis(zero, bookkeeping=False)["dp"]
    assert extra == 16 + 16  # (loss, tokens), and the shards' (split, replicated) squares


def test_full_recompute_and_sequence_parallel_terms():
    lay = Layout(tp=2)
    full = Workload(micro_batch=2, global_batch=8, precision=PRECISIONS["fp32"], recompute="full")
    none = Workload(micro_batch=2, global_batch=8, precision=PRECISIONS["fp32"])
    base = bytes_by_axis(rank_traffic(OURS, none, lay, 4, Coords()))["tp"]
    size = comm.all_reduce_bytes(comm.activation_message_bytes(OURS, none), 2)
    quiet = bytes_by_axis(rank_traffic(OURS, full, lay, 4, Coords()))["tp"]
    noisy = bytes_by_axis(rank_traffic(OURS, full, lay, 4, Coords(), dropout=0.1))["tp"]
    assert quiet - base == 4 * 8 * size  # K x layers x the attention's all-reduce
    assert noisy - base == 4 * 8 * 2 * size  # with dropout, the MLP's as well
    split = replace(lay, sequence_parallel=True)
    sp = bytes_by_axis(rank_traffic(OURS, none, split, 4, Coords()))["tp"]
    assert sp - base == 4 * replicated_params(OURS, lay, 0)  # one fp32 all-reduce at tp = 2
    # Selective repeats what full repeats; with sequence parallelism both also repeat the
    # all-gathers before q, k, v and the MLP: 1.5 all-reduces' bytes per block
    # (tests/test_recompute.py compares every rank's ledger with these counts).
    selective = replace(full, recompute="selective")
    assert bytes_by_axis(rank_traffic(OURS, selective, lay, 4, Coords()))["tp"] == quiet
    sp_full = rank_traffic(OURS, selective, split, 4, Coords())
    assert bytes_by_axis(sp_full)["tp"] - sp == 4 * 8 * 3 * size // 2


@pytest.mark.parametrize("n_layer", [2, 3])
def test_fsdp_units_are_the_models_units(n_layer):
    from paratrain.models.gpt import GPT, GPTConfig
    from paratrain.models.plans import GPT_PLAN
    from paratrain.parallel.data_parallel.fsdp_units import expand_units

    gpt = GPT(GPTConfig(256, n_layer, 4, 64, 32))
    counted = [
        sum(p.numel() for name in unit for p in gpt.get_submodule(name).parameters())
        for unit in expand_units(gpt, GPT_PLAN.fsdp_units)
    ]
    spec = ModelSpec("ours", n_layer=n_layer, d_model=64, n_head=4, vocab_size=256, seq_len=32)
    assert flat_buffers(spec, Layout(dp=2, zero=3)) == [counted]
    assert flat_buffers(spec, Layout(dp=2, zero=1)) == [[sum(counted)]]


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_state_padding_and_traffic_per_flat_buffer(zero):
    """Shards of ceil(n/k) per flat buffer; the whole ZeRO-1/2 buffers k ceil(n/k); the
    padding counted under params, as the runtime records it; traffic 2(k-1)S/k per step
    for ZeRO-1/2 and 3(k-1)S/k per micro-batch for ZeRO-3, S the padded buffers (fp32)."""
    rng = random.Random(zero)
    for _ in range(50):
        k, tp = rng.randint(2, 9), rng.choice([1, 2, 4])
        pp, v = (1, 1) if zero == 3 else rng.choice([(1, 1), (2, 1), (2, 2)])
        sched = "" if pp == 1 else ("interleaved" if v > 1 else "1f1b")
        lay = Layout(dp=k, tp=tp, pp=pp, zero=zero, schedule=sched, chunks=v)
        stage = rng.randrange(pp)
        buffers = [n for chunk in flat_buffers(OURS, lay, stage) for n in chunk]
        assert sum(buffers) == sum(chunk_params(OURS, lay, stage))
        shard = sum(math.ceil(n / k) for n in buffers)
        padded = sum(k * math.ceil(n / k) for n in buffers)
        held = held_model_state(OURS, FP32, lay, stage)
        assert held.optimizer == 8 * shard and held.master == 0
        assert held.grads == 4 * (padded if zero == 1 else shard)
        assert held.params == 4 * (shard if zero == 3 else padded)
        whole = 4 * (padded - sum(buffers))  # ZeRO-1/2: the whole buffers' padding
        beyond = shard - math.ceil(sum(buffers) / k)  # ZeRO-3: unit shards beyond ceil(N/k)
        want = (
            {"params": whole, "grads": whole if zero == 1 else 0, "optimizer": 0, "master": 0}
            if zero < 3
            else {"params": 4 * beyond, "grads": 4 * beyond, "optimizer": 8 * beyond, "master": 0}
        )
        assert padding_bytes(OURS, FP32, lay, stage) == want
        recorded = rank_model_state(OURS, FP32, lay, stage)
        assert recorded.total == held.total  # the same bytes, the padding under params
        assert recorded.params - held.params == sum(want.values()) - want["params"]
        kk = rng.randint(1, 8)
        terms = rank_traffic(OURS, FP32_FULL, lay, kk, Coords(stage=stage))
        planned = bytes_by_axis(terms, bookkeeping=False)["dp"]
        syncs = kk if zero == 3 else 1
        assert planned * k == syncs * (3 if zero == 3 else 2) * (k - 1) * 4 * padded
        if zero == 2:  # accumulate shard (default): K reduce-scatters, then the all-gather
            terms = rank_traffic(OURS, FP32, lay, kk, Coords(stage=stage))
            planned = bytes_by_axis(terms, bookkeeping=False)["dp"]
            assert planned * k == (kk + 1) * (k - 1) * 4 * padded
            whole = 4 * padded if kk > 1 else 0  # "full" holds the buckets, padded buffers
            assert accumulated_gradient_bytes(OURS, FP32_FULL, lay, kk, stage) == whole
            assert accumulated_gradient_bytes(OURS, FP32, lay, kk, stage) == 0


def test_zero2_accumulation_options_per_rank_by_hand():
    """OURS has N = 8 (12 64^2 + 13 64) + 2 256 64 + 32 64 + 2 64 = 434,816 parameters;
    over k = 3 a shard is ceil(N/3) = 144,939 and the flat buffer 3 x 144,939 = 434,817
    (one padding element). fp32, K = 4 micro-batches:
    - one reduce-scatter or all-gather sends (k-1) x 144,939 x 4 = 1,159,512 bytes;
    - full: one of each per step, 2,319,024; the buckets hold the whole padded gradient,
      434,817 x 4 = 1,739,268 bytes, from micro-batch 1 until the reduce-scatter;
    - shard: 4 reduce-scatters and one all-gather, 5 x 1,159,512 = 5,797,560; nothing held.
    The step-boundary state is the same: a gradient shard of 144,939 x 4 = 579,756."""
    lay = Layout(dp=3, zero=2)
    full, shard = FP32_FULL, FP32
    assert OURS.params == 434_816

    def dp_terms(w: Workload) -> dict[str, int]:
        return {t.what: t.bytes for t in rank_traffic(OURS, w, lay, 4, Coords()) if t.axis == "dp"}

    assert dp_terms(full) == {
        "gradients, once per step": 1_159_512,
        "updated parameters": 1_159_512,
        "(loss, tokens), float64": 16,
        "gradient-norm squares of the shards, float64": 16,
    }
    assert dp_terms(shard)["gradients, every micro-batch"] == 4 * 1_159_512
    assert bytes_by_axis(rank_traffic(OURS, shard, lay, 4, Coords()), False)["dp"] == 5_797_560
    assert accumulated_gradient_bytes(OURS, full, lay, 4) == 1_739_268
    assert accumulated_gradient_bytes(OURS, full, lay, 1) == 0  # nothing to accumulate
    assert accumulated_gradient_bytes(OURS, shard, lay, 4) == 0
    for w in (full, shard):
        state = rank_model_state(OURS, w, lay)
        assert (state.grads, state.grad_accumulation) == (579_756, 0)  # the step boundary


def test_zb_h1_slots_bubble_and_memory_follow_the_schedule():
    """ZB-H1 simulated with F = B = W = 1 (the runtime's schedule, its checker): idle
    (S-1) + max(0, S-K) per stage, a third of 1F1B's 3(S-1) once K >= S; every stage
    holds min(K, S) graphs until their deferred W. The 1F1B family idles 3(S-1)."""
    for s in range(1, 7):
        for k in range(1, 17):
            sim = check_schedule(build_schedule("zb-h1", s, k), Costs(1.0, 2.0))
            lay = Layout(pp=s, schedule="zb-h1") if s > 1 else Layout()
            for stage in range(s):
                idle = sim.makespan - sim.busy(stage)
                assert idle == pipeline.bubble_slots(s, k, 1, "zb-h1")
                if s > 1:
                    assert activations.in_flight_chunks(lay, k, stage) == sim.peak_in_flight[stage]
            frac = pipeline.bubble_fraction(s, k, 1, "zb-h1")
            assert frac == pytest.approx(sim.bubble_fraction())
            if k >= s:
                ofob = pipeline.bubble_slots(s, k, 1, "1f1b")
                assert 3 * pipeline.bubble_slots(s, k, 1, "zb-h1") == ofob
    for layout in PIPELINES:
        sim = check_schedule(
            build_schedule(layout.schedule, layout.pp, 8, layout.chunks), Costs(1.0, 2.0)
        )
        slots = pipeline.bubble_slots(layout.pp, 8, layout.chunks, layout.schedule)
        assert [sim.makespan - sim.busy(st) for st in range(layout.pp)] == [slots] * layout.pp
