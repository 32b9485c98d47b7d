"""Predicted against published: `paratrain plan --published`.

Each published run (plan/published.py) goes through `estimate` with its cluster preset's
one efficiency, nothing per run; the table shows published and predicted TFLOP/s per GPU
and the error, and the command fails when any row is off by more than TOLERANCE. The
layout comparisons check that the planner orders layouts of one workload as the paper's
figures do.
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.plan.estimate import Estimate, estimate
from paratrain.plan.published import (
    CALIBRATION_RUNS,
    LAYOUT_COMPARISONS,
    PUBLISHED_RUNS,
    LayoutComparison,
    PublishedRun,
)

TOLERANCE = 0.15  # the goal: every row within 15% of its published figure


def predict_published(run: PublishedRun, efficiency: float | None = None) -> Estimate:
    """The planner's estimate of the run; `efficiency` replaces its preset's."""
    return estimate(run.model(), run.cluster_spec(efficiency), run.workload(), run.layout())


def predicted_tflops(run: PublishedRun, efficiency: float | None = None) -> float:
    tflops = predict_published(run, efficiency).model_tflops_per_gpu
    assert tflops is not None, f"{run.name}: no step time"
    return tflops


def fit_efficiency(run: PublishedRun, digits: int = 4) -> float:
    """The efficiency at which the planner predicts the run's published TFLOP/s (bisection:
    predicted TFLOP/s grows with the efficiency), rounded to `digits`."""
    assert run.tflops_per_gpu is not None, f"{run.name}: nothing published to fit on"
    lo, hi = 1e-3, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if predicted_tflops(run, mid) < run.tflops_per_gpu else (lo, mid)
    return round((lo + hi) / 2, digits)


@dataclass(frozen=True)
class PublishedRow:
    run: PublishedRun
    label: str
    predicted: float

    @property
    def error(self) -> float:
        """(predicted - published) / published."""
        assert self.run.tflops_per_gpu is not None, self.run.name  # only published runs
        return self.predicted / self.run.tflops_per_gpu - 1


def compare_published(runs: tuple[PublishedRun, ...] = PUBLISHED_RUNS) -> list[PublishedRow]:
    return [PublishedRow(r, r.layout().label, predicted_tflops(r)) for r in runs]


def comparison_table(rows: list[PublishedRow]) -> str:
    """Markdown: run, layout, published, predicted, error; the calibration runs marked."""
    fitted = {r.name for r in CALIBRATION_RUNS.values()}
    lines = [
        "| run | layout (GPUs, b, G) | published TFLOP/s per GPU | predicted | error |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        r = row.run
        mark = " (fitted on)" if r.name in fitted else ""
        lines.append(
            f"| {r.name}{mark} | {row.label} ({r.gpus}, {r.micro_batch}, {r.global_batch}) | "
            f"{r.tflops_per_gpu:.0f} | {row.predicted:.1f} | {row.error:+.1%} |"
        )
    return "\n".join(lines)


def ranking(comparison: LayoutComparison) -> list[tuple[str, float]]:
    """The comparison's layouts fastest first by the planner, with predicted TFLOP/s."""
    scored = [(r.layout().label, predicted_tflops(r)) for r in comparison.runs]
    return sorted(scored, key=lambda x: -x[1])


def ranking_agrees(comparison: LayoutComparison) -> bool:
    """The planner's order is the published one (`published_order`, fastest first)."""
    order = [label for label, _ in ranking(comparison)]
    return order[: len(comparison.published_order)] == list(comparison.published_order)


def ranking_report() -> tuple[list[str], bool]:
    lines, ok = [], True
    for c in LAYOUT_COMPARISONS:
        agrees = ranking_agrees(c)
        ok &= agrees
        order = ", ".join(f"{label} {t:.0f}" for label, t in ranking(c))
        verdict = "agrees" if agrees else "DISAGREES"
        lines.append(f"- {c.name}: planner {order} TFLOP/s; published: {c.claim} ({verdict})")
    return lines, ok


def run_published() -> int:
    """Print the comparison and the rankings; 1 if a row is off by more than TOLERANCE or
    a ranking disagrees."""
    rows = compare_published()
    print(comparison_table(rows))
    off = [r.run.name for r in rows if abs(r.error) > TOLERANCE]
    lines, ranks_ok = ranking_report()
    print("\nlayouts of one workload, fastest first:")
    print("\n".join(lines))
    worst = max(rows, key=lambda r: abs(r.error))
    print(
        f"\n{len(rows) - len(off)} of {len(rows)} runs within {TOLERANCE:.0%} (worst "
        f"{worst.run.name} {worst.error:+.1%})" + (f"; off: {', '.join(off)}" if off else "")
    )
    return 0 if not off and ranks_ok else 1
