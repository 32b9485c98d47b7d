"""Schedules and their checker: pure, no processes.

Every valid (schedule, S, K, v) with S <= 4 and K <= 16 is proven complete and
deadlock-free, and its simulated bubble and peak in-flight activations are compared with
the formulas of the papers (docs/pipeline.md). Broken schedules must be rejected with a
message that says what is wrong.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from paratrain.config import SCHEDULES
from paratrain.measure.text_timeline import render_grid
from paratrain.parallel.pipeline import (
    Action,
    Costs,
    ScheduleError,
    build_schedule,
    check_schedule,
)
from paratrain.parallel.pipeline.batches import Batch, plan_calls
from paratrain.parallel.pipeline.schedules import RECV_B, RECV_F, SEND_B, SEND_F, B, F
from paratrain.parallel.pipeline.stream_check import check_streams
from paratrain.plan.pipeline import bubble_fraction


def valid_cases():
    for name in SCHEDULES:
        for s in range(1, 5):
            for k in range(1, 17):
                for v in (2, 3) if name == "interleaved" else (1,):
                    if name == "interleaved" and k % s:
                        continue
                    yield name, s, k, v


CASES = list(valid_cases())


def test_every_valid_combination_is_complete_and_deadlock_free():
    assert len(CASES) > 250
    for name, s, k, v in CASES:
        sim = check_schedule(build_schedule(name, s, k, v))
        computes = sum(len(row) for row in sim.slots)
        per_unit = 3 if name == "zb-h1" else 2  # F + B, or F + BI + BW
        assert computes == per_unit * s * k * v, (name, s, k, v)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved"])
@pytest.mark.parametrize("backward", [1.0, 2.0])
def test_simulated_bubble_equals_the_formula(name, backward):
    """Unit-cost model: (S-1)/(K+S-1) for GPipe and 1F1B, (S-1)/(vK+S-1) interleaved,
    on every stage, with backward = forward and with backward = 2 x forward."""
    for n, s, k, v in CASES:
        if n != name:
            continue
        sim = check_schedule(build_schedule(name, s, k, v), Costs(1.0, backward))
        for stage in range(s):
            assert sim.bubble_fraction(stage) == pytest.approx(bubble_fraction(s, k, v)), (
                name,
                s,
                k,
                v,
                stage,
            )


def test_zb_h1_bubble_is_a_third_of_1f1b_when_f_b_w_are_equal():
    """Qi et al. 2023: ZB-H1 idles (S-1)(F+B-W), 1F1B (S-1)(F+B+W); with F = B = W
    that is S - 1 against 3 (S - 1) units per stage, for K >= S."""
    for s in range(2, 5):
        for k in range(s, 17):
            zb = check_schedule(build_schedule("zb-h1", s, k), Costs(1.0, 2.0))
            ofob = check_schedule(build_schedule("1f1b", s, k), Costs(1.0, 2.0))
            assert zb.makespan - 3 * k == pytest.approx(s - 1)
            assert ofob.makespan - 3 * k == pytest.approx(3 * (s - 1))


def test_peak_in_flight_gpipe_holds_all_k_1f1b_at_most_s_minus_stage():
    for s in range(1, 5):
        for k in range(1, 17):
            gpipe = check_schedule(build_schedule("gpipe", s, k))
            ofob = check_schedule(build_schedule("1f1b", s, k))
            assert gpipe.peak_in_flight == tuple([k] * s)
            assert ofob.peak_in_flight == tuple(min(s - i, k) for i in range(s))


def test_interleaved_warm_up_matches_megatron():
    """Stage s holds 2(S-s-1) + (v-1)S + 1 chunk activations at most (capped at vK)."""
    for s, k, v in [(2, 4, 2), (4, 8, 2), (4, 16, 3)]:
        sim = check_schedule(build_schedule("interleaved", s, k, v))
        want = tuple(min(2 * (s - i - 1) + (v - 1) * s + 1, v * k) for i in range(s))
        assert sim.peak_in_flight == want


@pytest.mark.parametrize(
    "args, message",
    [
        (("interleaved", 4, 6, 2), "num_microbatches=6 is not a multiple of num_stages=4"),
        (("interleaved", 2, 4, 1), "chunks=1; valid: chunks >= 2"),
        (("1f1b", 2, 4, 2), "chunks=2; valid: 1"),
        (("gpipe", 0, 4, 1), "num_stages=0"),
        (("zb-h1", 2, 0, 1), "num_microbatches=0"),
        (("pipedream", 2, 4, 1), "unknown schedule 'pipedream'; valid: gpipe, 1f1b"),
    ],
)
def test_invalid_combinations_are_refused_with_the_numbers(args, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        build_schedule(*args)


def _edit(schedule, stage, actions):
    stages = list(schedule.stages)
    stages[stage] = tuple(actions)
    return replace(schedule, stages=tuple(stages))


def test_a_missing_backward_is_rejected():
    sch = build_schedule("1f1b", 2, 4)
    broken = _edit(sch, 0, [a for a in sch.stages[0] if a != Action(B, 2)])
    with pytest.raises(ScheduleError, match="stage 0: micro-batch 2 chunk 0 has B x0"):
        check_schedule(broken)


def test_a_duplicate_forward_is_rejected():
    sch = build_schedule("gpipe", 2, 2)
    broken = _edit(sch, 1, list(sch.stages[1]) + [Action(F, 0)])
    with pytest.raises(ScheduleError, match="micro-batch 0 chunk 0 has 2 forwards"):
        check_schedule(broken)


def test_an_unmatched_send_is_rejected():
    """The last stage sends an activation onward, to a chunk that does not exist."""
    sch = build_schedule("1f1b", 2, 4)
    broken = _edit(sch, 1, list(sch.stages[1]) + [Action(SEND_F, 2, 0, 0)])
    with pytest.raises(ScheduleError, match="unmatched send: stage 1 sent act of micro-batch 2"):
        check_schedule(broken)


def test_a_duplicate_send_is_rejected():
    sch = build_schedule("gpipe", 2, 4)
    broken = _edit(sch, 0, list(sch.stages[0]) + [Action(SEND_F, 0, 0, 1)])
    with pytest.raises(ScheduleError, match="sends the same message twice"):
        check_schedule(broken)


def test_a_cyclic_wait_is_rejected():
    """Stage 0 waits for micro-batch 0's gradient before sending its activation."""
    sch = build_schedule("1f1b", 2, 2)
    s0 = [a for a in sch.stages[0] if a != Action(SEND_F, 0, 0, 1)]
    at = s0.index(Action(RECV_B, 0, 0, 1))
    s0.insert(at + 1, Action(SEND_F, 0, 0, 1))
    with pytest.raises(ScheduleError, match=r"cyclic wait \(deadlock\): stage 0 .*RECV_B0.0"):
        check_schedule(_edit(sch, 0, s0))


def test_a_receive_nobody_sends_is_rejected():
    sch = build_schedule("gpipe", 2, 2)
    s1 = [a for a in sch.stages[1] if a != Action(SEND_B, 1, 0, 0)]
    with pytest.raises(ScheduleError, match="stage 0 .*RECV_B1.0<-1.* finished without sending"):
        check_schedule(_edit(sch, 1, s1))


def test_a_compute_before_its_input_is_rejected():
    sch = build_schedule("gpipe", 2, 2)
    s1 = list(sch.stages[1])
    s1.remove(Action(RECV_F, 1, 0, 0))
    s1.insert(s1.index(Action(F, 1)) + 1, Action(RECV_F, 1, 0, 0))
    with pytest.raises(ScheduleError, match="stage 1 action #.* F1.0: runs before its input"):
        check_schedule(_edit(sch, 1, s1))


def test_timeline_renders_the_1f1b_example():
    text = render_grid(check_schedule(build_schedule("1f1b", 4, 8)))
    lines = text.splitlines()
    assert lines[0].startswith("stage 0 |F0 F1 F2 F3 .  .  .  B0 F4 B1")
    assert lines[3].startswith("stage 3 |.  .  .  F0 B0 F1 B1")
    assert "bubble 0.273" in lines[-1] and "peak in-flight [4, 3, 2, 1]" in lines[-1]


def test_forward_only_schedule_for_evaluation():
    for s, k, v in [(1, 3, 1), (2, 3, 2), (4, 5, 1), (4, 8, 3)]:
        sim = check_schedule(build_schedule("forward", s, k, v))
        assert all(len(row) == k * v for row in sim.slots)
        assert sim.peak_in_flight == (0,) * s  # nothing is kept for a backward


def nccl_cases():
    """The range issue 28 names: pp 2-8, K 1-16, chunks 1-4, every schedule."""
    for name in SCHEDULES:
        for s in range(2, 9):
            for k in range(1, 17):
                for v in range(1, 5) if name == "interleaved" else (1,):
                    try:
                        yield build_schedule(name, s, k, v)
                    except ValueError:  # refused combination (K not a multiple of S, ...)
                        continue


def test_every_schedule_completes_on_nccl_streams():
    """The runtime's group calls (batches.py) complete under NCCL's stream semantics for
    every schedule in the range; check_schedule runs this proof before every step."""
    schedules = list(nccl_cases())
    assert len(schedules) > 400
    for schedule in schedules:
        check_streams(schedule)


def test_receives_posted_ahead_are_found_to_hang_on_nccl_streams():
    """The runtime as it was (issue 28): each message its own call, and stage 1 posting
    all its receives at its first RECV. gloo ran it; NCCL's streams would not."""
    schedule = build_schedule("1f1b", 2, 4)
    first = (Batch(0, (), ((0, ("act", m, 0)),)) for m in range(4))
    stage1 = tuple(first) + tuple(Batch(4 * m + 4, ((0, ("grad", m, 0)),), ()) for m in range(4))
    stage0 = []
    for i, a in enumerate(schedule.stages[0]):
        if a.kind == SEND_F:
            stage0.append(Batch(i + 1, ((1, ("act", a.microbatch, 0)),), ()))
        elif a.kind == RECV_B:
            stage0.append(Batch(i, (), ((1, ("grad", a.microbatch, 0)),)))
    with pytest.raises(ScheduleError, match="would hang on NCCL's streams"):
        check_streams(schedule, (tuple(stage0), stage1))
    check_streams(schedule)  # the calls plan_calls places for it complete


def test_each_message_leaves_after_its_send_and_is_posted_by_its_receive():
    """pp 2, K 4, 1F1B: one call per message on each side; the sender's right after its
    SEND, the receiver's no later than its RECV, so it travels during compute."""
    schedule = build_schedule("1f1b", 2, 4)
    calls = plan_calls(schedule)
    for stage, mine in enumerate(calls):
        actions = schedule.stages[stage]
        sent = [c for c in mine if c.sends]
        assert all(len(c.sends) == 1 and not c.recvs for c in sent)
        assert [actions[c.at - 1].kind for c in sent] == [SEND_F if stage == 0 else SEND_B] * 4
        for call in (c for c in mine if c.recvs):
            (_, key), want = call.recvs[0], RECV_B if stage == 0 else RECV_F
            at = next(i for i, a in enumerate(actions) if a.kind == want and
                      (a.microbatch, a.chunk) == key[1:])  # fmt: skip
            assert call.at <= at
