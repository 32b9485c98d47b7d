"""Timing two sides of a comparison fairly, and the check that voids a comparison.

Each pair runs one step of each side on the same batch with the same timer; even pairs run
ours first, odd pairs the peer, so that neither side always inherits the other's warm
caches. The report gives both medians and the median of the pairwise ratios ours / peer
with their quartiles and range: pairing cancels the machine's slow drifts, which shift
both steps of a pair alike. A comparison whose two sides' losses differ beyond a tolerance
did not do the same work, and its times mean nothing: `check_losses` raises then.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple, TypeVar

import torch

# One training step of a side on this rank's micro-batches; returns the step's loss.
Side = Callable[[list[torch.Tensor]], float]
Batch = TypeVar("Batch")  # what both sides of one comparison take: micro-batches, mostly


class PairRow(NamedTuple):
    ours_s: float
    peer_s: float
    ours_loss: float
    peer_loss: float


def time_pairs(
    ours: Callable[[Batch], float],
    peer: Callable[[Batch], float],
    batches: Sequence[Batch],
    sync: Callable[[], None] = lambda: None,
) -> list[PairRow]:
    """One step of each side per batch (a list of micro-batches), alternating which goes
    first; `sync` runs before each timed step (a barrier, so that all ranks start it
    together, where a step's time is the slowest rank's)."""
    rows = []
    for i, batch in enumerate(batches):
        took, loss = {}, {}
        for is_ours in (True, False) if i % 2 == 0 else (False, True):
            step = ours if is_ours else peer
            sync()
            start = time.perf_counter()
            loss[is_ours] = step(batch)
            took[is_ours] = time.perf_counter() - start
        rows.append(PairRow(took[True], took[False], loss[True], loss[False]))
    return rows


def ratio_summary(ours_s: Sequence[float], peer_s: Sequence[float]) -> dict[str, float]:
    """Both sides' median step and the pairwise ratios ours / peer: median, quartiles, range."""
    ratios = sorted(o / p for o, p in zip(ours_s, peer_s, strict=True))
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    return {
        "ours_step_s": statistics.median(ours_s),
        "torch_step_s": statistics.median(peer_s),
        "ratio": statistics.median(ratios),
        "ratio_min": ratios[0],
        "ratio_q1": q1,
        "ratio_q3": q3,
        "ratio_max": ratios[-1],
        "pairs": len(ratios),
    }


# The benches' LOSS_RTOL (bench/*/: zero, dp, overhead, pp, tp), one argument for all: the
# two sides train the same weights on the same batches with the same float32 operations,
# ours adding some sums in another order (split over ranks, our collectives, the loss
# scaled per micro-batch). A sum of K terms reordered moves by at most 2·K·u·Σ|terms|
# (u = 2^-24, Higham's γ_K), typically √K·u: for these models' K (at most a few thousand)
# 1e-7 to 3e-6 of a well-conditioned loss at step 1. Later steps add the weights'
# difference, which AdamW amplifies (a near-zero gradient's rounding can flip a whole
# step of lr), so no a-priori bound holds over the steps: the rtol screens "comparable"
# runs, it is no equivalence test (tests/ derives those from float64). 1e-4 sits over an
# order above the reordering's size after the benches' few dozen steps and two below what
# a wrong scale or a lost micro-batch moves the loss (1e-2 and more).
def check_losses(
    ours: Sequence[float], peer: Sequence[float], rtol: float, where: str = ""
) -> float:
    """The largest relative difference |ours - peer| / |peer| over the steps; RuntimeError
    at the first step beyond `rtol` (`where` prefixes the message, e.g. "stage 1: ")."""
    worst = 0.0
    for step, (o, p) in enumerate(zip(ours, peer, strict=True)):
        rel = abs(o - p) / abs(p)
        if not rel <= rtol:  # a NaN fails too
            raise RuntimeError(
                f"{where}losses differ at step {step} (ours {o:.6f}, torch {p:.6f}, relative "
                f"{rel:.1e} > {rtol:g}): the runs are not comparable"
            )
        worst = max(worst, rel)
    return worst


def check_mean_losses(
    per_rank: Sequence[Sequence[tuple[float, float]]], rtol: float, where: str = ""
) -> float:
    """`check_losses` for data parallelism, from each rank's (ours, peer) loss per step.

    Ours is the global batch's mean, the same on every rank; a peer's is its own rank's,
    so ours is compared with their mean (every rank holds as many target tokens).
    """
    steps = range(len(per_rank[0]))
    ours = [per_rank[0][i][0] for i in steps]
    peer = [statistics.fmean(rank[i][1] for rank in per_rank) for i in steps]
    return check_losses(ours, peer, rtol, where)
