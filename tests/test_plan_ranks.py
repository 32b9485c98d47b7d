"""The planner's per-rank and per-stage counts against the objects the runtime uses.

Pure tests: the parameter split against the real GPT sliced by tensor parallelism and cut
into stages is in `plan --validate`; here the closed forms are checked against the model's
own count and against the pipeline schedules (the same objects the runtime executes).
"""

from __future__ import annotations

import itertools

import pytest

from paratrain.parallel.pipeline import build_schedule, check_schedule
from paratrain.parallel.pipeline.schedules import SEND_B, SEND_F
from paratrain.plan import comm, memory, pipeline
from paratrain.plan.layout import PRECISIONS, Layout, Workload
from paratrain.plan.model import ModelSpec, gpt_param_count
from paratrain.plan.ranks import (
    ONE_NODE,
    Coords,
    bytes_by_axis,
    chunk_params,
    rank_model_state,
    rank_traffic,
    replicated_params,
)

OURS = ModelSpec("ours", n_layer=8, d_model=64, n_head=4, vocab_size=256, seq_len=32)
FP32 = Workload(micro_batch=2, global_batch=16, precision=PRECISIONS["fp32"])
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
        assert memory.in_flight_chunks(layout, k, stage) == sim.peak_in_flight[stage]
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
    sp = bytes_by_axis(rank_traffic(OURS, none, lay, 4, Coords(), sequence_parallel=True))["tp"]
    assert sp - base == 4 * replicated_params(OURS, lay, 0)  # one fp32 all-reduce at tp = 2
