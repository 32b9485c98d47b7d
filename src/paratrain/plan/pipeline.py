"""Pipeline bubbles: the idle fraction of a step caused by filling and draining stages.

With S stages, K micro-batches and forward + backward of one micro-batch on one stage
taking t, GPipe (arXiv:1811.06965) and 1F1B (PipeDream-Flush, arXiv:2006.09503) both
idle (S - 1) t per stage out of a step of (K + S - 1) t, so the bubble is
(S - 1) / (K + S - 1) of the step, or (S - 1) / K of the useful time (seeds, section 5.1:
S = 4, K = 8 gives 3 / 11, about 27%). The interleaved schedule (Narayanan et al.,
arXiv:2104.04473, section 2.2.2) gives each GPU v chunks of 1/v the work, so the bubble
time shrinks by v: (S - 1) / (v K + S - 1) of the step. The 1F1B family changes memory
(see activations.in_flight_microbatches), not the bubble.

ZB-H1 (Qi et al. 2023, arXiv:2401.10241, section 3.1) splits the backward into B (input
gradient) and W (weight gradient) and defers W into the cool-down: a stage idles
(S - 1)(F + B - W) instead of 1F1B's (S - 1)(F + B + W), for K >= S. With fewer
micro-batches there are too few W to fill the cool-down: the runtime's schedule
(parallel/pipeline/schedules.py) then idles (S - 1)(F + B - W) + (S - K) W, as its
simulation shows for every S, K when W <= F. The planner assumes F = B = W (the paper's
assumption for "a third of 1F1B's bubble"), so in units of one of them a stage is busy
3 K and idles (S - 1) + max(0, S - K): `bubble_slots`.
"""

from __future__ import annotations


def _check(stages: int, microbatches: int, chunks: int) -> None:
    if stages < 1 or microbatches < 1 or chunks < 1:
        raise ValueError(
            f"stages {stages}, micro-batches {microbatches}, chunks {chunks}: all must be >= 1"
        )


def bubble_slots(stages: int, microbatches: int, chunks: int = 1, schedule: str = "") -> int:
    """Idle time of each stage per step, in units of one chunk's F = B = W.

    GPipe, 1F1B and interleaved: 3 (S - 1) (F + B + W per fill-and-drain step, chunk
    units); ZB-H1: (S - 1) + max(0, S - K). A stage is busy 3 v K units in either case.
    """
    _check(stages, microbatches, chunks)
    if schedule == "zb-h1":
        return stages - 1 + max(0, stages - microbatches)
    return 3 * (stages - 1)


def bubble_fraction(
    stages: int, microbatches: int, chunks: int = 1, schedule: str = "", backward: float = 2.0
) -> float:
    """Idle fraction of a pipeline step: (S - 1) / (v K + S - 1); 0 without a pipeline.

    ZB-H1, with one chunk's forward F = 1 and its whole backward `backward` (B + W, each
    half of it; 2 is the planner's F = B = W): a stage idles (S - 1) F + max(0, S - K) W
    and is busy K (F + B + W), so (S - 1 + max(0, S - K) W) / (K (1 + backward) + idle).
    Only ZB-H1's bubble depends on the backward's cost; the others' is a ratio of counts.
    """
    _check(stages, microbatches, chunks)
    if schedule != "zb-h1":
        return (stages - 1) / (chunks * microbatches + stages - 1)
    if backward <= 0:
        raise ValueError(f"backward cost {backward}; valid: > 0")
    idle = stages - 1 + max(0, stages - microbatches) * backward / 2
    return idle / (chunks * microbatches * (1 + backward) + idle)


# How the formula reads, per schedule, for reports beside a simulated or measured bubble.
FORMULA_READS = {
    "interleaved": "(S-1)/(vK+S-1)",
    "zb-h1": "(S-1+max(0,S-K)W)/(K(F+B+W)+idle), F=1",
}
DEFAULT_FORMULA_READS = "(S-1)/(K+S-1)"


def bubble_time(
    busy_s: float, stages: int, microbatches: int, chunks: int = 1, schedule: str = ""
) -> float:
    """Idle seconds added to a step whose useful work takes busy_s: busy (S-1) / (v K);
    ZB-H1: busy (S - 1 + max(0, S - K)) / (3 K)."""
    idle = bubble_slots(stages, microbatches, chunks, schedule)
    return busy_s * idle / (3 * chunks * microbatches)


def microbatches_for_bubble(stages: int, target: float, chunks: int = 1, schedule: str = "") -> int:
    """Smallest K with a bubble fraction at most `target` (0 < target < 1)."""
    if not 0 < target < 1:
        raise ValueError(f"bubble target {target}; valid: 0 < target < 1")
    # (S-1) / (vK + S-1) <= f  <=>  K >= (S-1)(1-f) / (f v); ZB-H1 (K >= S): a third of it
    k = max(1, int((stages - 1) * (1 - target) / (target * chunks)))
    if schedule == "zb-h1":
        k = max(1, k // 3)
    while bubble_fraction(stages, k, chunks, schedule) > target:
        k += 1
    return k


def virtual_stage_layers(n_layer: int, stages: int, chunks: int = 1) -> list[int]:
    """Blocks of each virtual stage 0 .. S v - 1, as the runtime cuts them.

    Contiguous pieces whose sizes differ by at most one, the larger ones first (the
    runtime's `balance='layers'`, parallel/pipeline/stage.py). Virtual stage c S + s is
    chunk c of stage s (arXiv:2104.04473, section 2.2.2).
    """
    parts = stages * chunks
    base, extra = divmod(n_layer, parts)
    return [base + (1 if p < extra else 0) for p in range(parts)]


def stage_virtual_stages(stage: int, stages: int, chunks: int = 1) -> list[int]:
    """The virtual stages that `stage` holds, in chunk order: stage, S + stage, ..."""
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} outside 0..{stages - 1}")
    return [c * stages + stage for c in range(chunks)]


def stage_layers(n_layer: int, stage: int, stages: int, chunks: int = 1) -> int:
    """Layers pipeline stage `stage` holds over its chunks (all of them with one stage)."""
    pieces = virtual_stage_layers(n_layer, stages, chunks)
    return sum(pieces[vs] for vs in stage_virtual_stages(stage, stages, chunks))


def recompute_passes(schedule: str, vs: int) -> int:
    """How often a chunk's recomputation runs per micro-batch: once; under ZB-H1 twice on
    every virtual stage but the first, whose input needs a gradient: its input pass and
    its weight pass each recompute (parallel/pipeline/split_backward.py), since the two
    use saved tensors in common (a LayerNorm's), which one graph-exec group cannot share.
    Found by `paratrain simulate --pp 2 --schedule zb-h1 --recompute full`."""
    return 2 if schedule == "zb-h1" and vs > 0 else 1


def recomputed_layers(n_layer: int, stage: int, stages: int, chunks: int, schedule: str) -> int:
    """The layers `stage` recomputes per micro-batch, each as often as it runs
    (`recompute_passes`)."""
    pieces = virtual_stage_layers(n_layer, stages, chunks)
    vss = stage_virtual_stages(stage, stages, chunks)
    return sum(pieces[vs] * recompute_passes(schedule, vs) for vs in vss)
