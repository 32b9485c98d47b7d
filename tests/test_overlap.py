"""Overlap proven by time (bench/overlap/measure.py): steps with overlap on and off
alternate, for DP buckets, ZeRO-2's reduce-scatters and FSDP's prefetched gathers, with the
backend's collectives and with our ring on its communication thread.

Asserted: at least half of the communication hidden, as seen by the training thread: the
seconds it was blocked in waits with overlap on, against the seconds the same calls took
with it off (1 - W_on / C_off), each step started at a barrier and each wait taken from
the rank that waited least, so a peer's late compute is not counted as communication.
That figure stays steady with other work on the machine (0.82-0.88 beside three busy
processes; before the barrier it dropped to 0.40-0.50 in a suite run).
The fraction from whole step times, (T_off - T_on) / C_off, is what `paratrain bench
overlap` reports on a quiet machine (docs/benchmarks.md); with two CPU-bound processes
beside the test its pairs scatter by more than the effect, so here it is only required to
show overlap making the steps faster. The control, both sides without overlap, stays
well below the goal (under 0.3: with two test files at a time and a loaded machine, pair
noise alone reached 0.23 in one run of 5 pairs, so "nothing hidden" is held as "not
near what the real test asserts"); and with our ring made blocking again (its call run
before the hook returns) the asserted fractions were -0.01, 0.03 and -0.02 and this test
failed (-0.06 for ZeRO-2 with the barrier, 2026-12-07)."""

from __future__ import annotations

import statistics

import pytest

from paratrain.bench.overlap.measure import MECHANISMS, LinearStack, measure
from tests.distributed import run_distributed

WORKLOAD = LinearStack(pairs=7)
GOAL = 0.5


# A measurement takes 10-15 s alone; at the suite's tail on 2 cores, beside a 4-rank test
# and a third file, one took over 120 s, and once over 400 s (CI, 2026-12-03). The measured
# fraction holds under such load (below); only the waiting needs room.
MEASURE_TIMEOUT_S = 600


def hidden(mechanism: str, algo: str, workload: LinearStack) -> tuple[float, list[float]]:
    """The median fraction hidden as the training thread saw it (both ranks), and every
    pair's fraction from step times."""
    ranks = run_distributed(measure, 2, mechanism, algo, workload, timeout=MEASURE_TIMEOUT_S)
    by_wait = statistics.median(r["hidden_by_wait"] for r in ranks)
    return by_wait, [h for r in ranks for h in r["hidden_all"]]


# Measurements per algorithm before the goal is declared missed. With two test files at a
# time on two cores, the communication thread can go unscheduled for a whole pair and
# its wait shows as exposed: measured 0.47 once in CI where a quiet machine gives 0.86.
# A lost overlap measures near 0 every time (the control below, and the blocking ring in
# the docstring: -0.01 to 0.03), so a second or third measurement cannot pass it.
ATTEMPTS = 3


@pytest.mark.timeout(ATTEMPTS * 2 * MEASURE_TIMEOUT_S)
@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_half_the_communication_hides_behind_compute(mechanism):
    by_step = []
    for algo in ("native", "ring"):
        seen = []
        for _ in range(ATTEMPTS):
            by_wait, pairs = hidden(mechanism, algo, WORKLOAD)
            seen.append(by_wait)
            if by_wait >= GOAL:
                break
        assert by_wait >= GOAL, (algo, seen, pairs)
        by_step += pairs
    assert statistics.median(by_step) > 0, by_step  # the steps got faster


@pytest.mark.timeout(ATTEMPTS * MEASURE_TIMEOUT_S)  # the measurement's own timeout says more
def test_without_overlap_nothing_appears_hidden():
    """What must not appear is hidden communication, measured as the real test measures
    it: up to ATTEMPTS times, as a pair of identical sides scatters under load both ways
    (measured -0.44 once in CI beside a 4-rank run; below zero is a wait that got longer,
    no sign of a false overlap). A metric that reported hiding where there is none would
    do so every time, and fail."""
    seen = []
    for _ in range(ATTEMPTS):
        by_wait, pairs = hidden("dp-buckets", "ring", LinearStack(pairs=7, control=True))
        seen.append(by_wait)
        if by_wait < GOAL - 0.2:
            break
    assert by_wait < GOAL - 0.2, (seen, pairs)
