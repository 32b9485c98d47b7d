"""Pipeline bubbles: the idle fraction of a step caused by filling and draining stages.

With S stages, K micro-batches and forward + backward of one micro-batch on one stage
taking t, GPipe (arXiv:1811.06965) and 1F1B (PipeDream-Flush, arXiv:2006.09503) both
idle (S - 1) t per stage out of a step of (K + S - 1) t, so the bubble is
(S - 1) / (K + S - 1) of the step, or (S - 1) / K of the useful time (seeds, section 5.1:
S = 4, K = 8 gives 3 / 11, about 27%). The interleaved schedule (Narayanan et al.,
arXiv:2104.04473, section 2.2.2) gives each GPU v chunks of 1/v the work, so the bubble
time shrinks by v: (S - 1) / (v K + S - 1) of the step. The 1F1B family changes memory
(see memory.in_flight_microbatches), not the bubble.
"""

from __future__ import annotations


def bubble_fraction(stages: int, microbatches: int, chunks: int = 1) -> float:
    """Idle fraction of a pipeline step: (S - 1) / (v K + S - 1); 0 without a pipeline."""
    if stages < 1 or microbatches < 1 or chunks < 1:
        raise ValueError(
            f"stages {stages}, micro-batches {microbatches}, chunks {chunks}: all must be >= 1"
        )
    return (stages - 1) / (chunks * microbatches + stages - 1)


def bubble_time(busy_s: float, stages: int, microbatches: int, chunks: int = 1) -> float:
    """Idle seconds added to a step whose useful work takes busy_s: busy (S-1) / (v K)."""
    return busy_s * (stages - 1) / (chunks * microbatches)


def microbatches_for_bubble(stages: int, target: float, chunks: int = 1) -> int:
    """Smallest K with a bubble fraction at most `target` (0 < target < 1)."""
    if not 0 < target < 1:
        raise ValueError(f"bubble target {target}; valid: 0 < target < 1")
    # (S-1) / (vK + S-1) <= f  <=>  K >= (S-1)(1-f) / (f v)
    k = max(1, int((stages - 1) * (1 - target) / (target * chunks)))
    while bubble_fraction(stages, k, chunks) > target:
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
