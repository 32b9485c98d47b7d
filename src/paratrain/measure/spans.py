"""Timelines as spans on one time axis: which stage did what, from when to when.

The common currency of the timeline files (chrome_trace.py, gantt.py). A pipeline's
simulated schedule and the steps its runtime recorded are both converted to Spans
(pipeline_spans.py), so a simulated and a measured chart are drawn by the same
code and can be put side by side.

Names follow the pipeline's text grid: `F3` is the forward of micro-batch 3, `B3` its
backward, `BI3` / `BW3` the split halves; with several chunks per stage the chunk is
appended, `F3c1`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# Compute categories in legend order; everything else a stage does is communication.
COMPUTE_CATEGORIES = ("forward", "backward", "backward-input", "backward-weight")
COMM = "comm"


@dataclass(frozen=True)
class Span:
    """One action of one stage, in seconds from the step's start."""

    stage: int
    kind: str  # F, B, BI, BW, or a communication kind (SEND_F, RECV_B, ...)
    category: str  # one of COMPUTE_CATEGORIES, or COMM
    microbatch: int
    chunk: int
    start: float
    end: float

    @property
    def is_compute(self) -> bool:
        return self.category != COMM


def span_name(span: Span, chunks: int) -> str:
    """`F3`, `BW0`, or with several chunks per stage `F3c1`."""
    return f"{span.kind}{span.microbatch}" + (f"c{span.chunk}" if chunks > 1 else "")


def idle_fractions(spans: Sequence[Span], num_stages: int) -> list[float]:
    """Per stage, time not computing over the whole window (first start to last end)."""
    if not spans:
        return [0.0] * num_stages
    start, end = min(s.start for s in spans), max(s.end for s in spans)
    window = end - start
    busy = [0.0] * num_stages
    for s in spans:
        if s.is_compute:
            busy[s.stage] += s.end - s.start
    return [1.0 - b / window if window > 0 else 0.0 for b in busy]
