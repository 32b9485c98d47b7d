"""A timeline as a PNG Gantt chart: one row per stage, stage 0 on top, idle time grey.

Forward, backward and the two halves of a split backward have distinct colours; chunks
after the first are hatched. Only compute spans are drawn: waiting shows as idle.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from paratrain.measure.spans import COMPUTE_CATEGORIES, Span, idle_fractions

# Colour-blind-safe (Okabe-Ito); chunk c > 0 is drawn hatched in the same colour.
COLOUR = {
    "forward": "#0072B2",
    "backward": "#D55E00",
    "backward-input": "#E69F00",
    "backward-weight": "#009E73",
}
IDLE_COLOUR = "#EEEEEE"
TIME_SCALE = {"s": 1.0, "ms": 1e3, "us": 1e6, "slots": 1.0}


def write_gantt(
    spans: Sequence[Span],
    path: str | Path,
    num_stages: int,
    chunks: int = 1,
    title: str = "",
    idle: Sequence[float] | None = None,
    time_unit: str = "ms",
) -> Path:
    """Draw the compute spans to `path` (parent folders created) and return it.

    `idle` (per stage, e.g. the runtime's own measured bubble) is written at the right of
    each row; by default it is computed from the spans.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    from matplotlib import pyplot as plt

    scale = TIME_SCALE[time_unit]
    compute = [s for s in spans if s.is_compute]
    idle = list(idle) if idle is not None else idle_fractions(compute, num_stages)
    end = max((s.end for s in compute), default=1.0) * scale
    height = 0.9 + 0.55 * num_stages  # inches: a fixed margin plus one band per stage
    fig, ax = plt.subplots(figsize=(10, height), dpi=100)
    _draw_rows(ax, num_stages, end, idle)
    for s in compute:
        _draw_span(ax, s, num_stages, scale, end)
    ax.set_yticks(range(num_stages), [f"stage {s}" for s in reversed(range(num_stages))])
    ax.set_xlim(0, end * 1.1)
    ax.set_xlabel(f"time ({time_unit})")
    _add_legend(fig, compute, chunks)
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.35 / height, 1, 1))  # leave the bottom band to the legend
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def _draw_rows(ax: Any, num_stages: int, end: float, idle: Sequence[float]) -> None:
    """The grey background of every row, with its idle fraction written at its right."""
    for stage in range(num_stages):  # y = S - 1 - stage puts stage 0 on top
        y = num_stages - 1 - stage
        ax.barh(y, end, left=0, height=0.8, color=IDLE_COLOUR)
        ax.text(end * 1.01, y, f"idle {idle[stage]:.0%}", va="center", fontsize=8)


def _draw_span(ax: Any, s: Span, num_stages: int, scale: float, end: float) -> None:
    left, width = s.start * scale, (s.end - s.start) * scale
    y = num_stages - 1 - s.stage
    hatch = "//" if s.chunk > 0 else None
    ax.barh(
        y,
        width,
        left=left,
        height=0.8,
        color=COLOUR[s.category],
        edgecolor="white",
        linewidth=0.5,
        hatch=hatch,
    )
    if width > end / 60:  # label only bars wide enough to hold it
        ax.text(
            left + width / 2,
            y,
            str(s.microbatch),
            ha="center",
            va="center",
            fontsize=6,
            color="white",
        )


def _add_legend(fig: Any, compute: Sequence[Span], chunks: int) -> None:
    """One entry per category drawn, then idle, then the hatch of later chunks."""
    from matplotlib.patches import Patch

    drawn = {s.category for s in compute}
    handles = [Patch(color=COLOUR[c], label=c) for c in COMPUTE_CATEGORIES if c in drawn]
    handles.append(Patch(color=IDLE_COLOUR, label="idle"))
    if chunks > 1:
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="chunk > 0"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
