"""The PNG chart of a plan (`paratrain plan --chart FILE`): memory and step time of the
table's layouts, the recommended and the fastest always among them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from paratrain.plan.cluster import GB
from paratrain.plan.estimate import Estimate
from paratrain.plan.recommend import Plan
from paratrain.plan.summary import fastest_fitting, shown_rows
from paratrain.plan.time import StepTime


def chart_layouts(plan: Plan, sort: str = "time", max_layouts: int = 24) -> list[Estimate]:
    """The table's fitting layouts by `sort`, the recommended first, the fastest always in."""
    shown = [e for e in shown_rows(plan, sort, show_all=True) if e.time is not None]
    shown = shown[:max_layouts]
    quick = fastest_fitting(plan)
    if quick is not None and quick not in shown:
        shown[-1:] = [quick]
    return shown


def chart(plan: Plan, path: str | Path, sort: str = "time", max_layouts: int = 24) -> Path:
    """Two panels: memory per GPU stacked by kind against capacity; step time by part. The
    layouts are the table's (the recommended first, the fastest among them)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown, quick = chart_layouts(plan, sort, max_layouts), fastest_fitting(plan)
    # "*" marks the recommendation, "f" the fastest layout that fits.
    labels = [
        ("* " if e is plan.recommended else "f " if e is quick else "") + e.layout.label
        for e in shown
    ]
    x = range(len(shown))
    fig, (ax_mem, ax_time) = plt.subplots(2, 1, figsize=(max(8, 0.5 * len(shown) + 3), 9))
    bottom = [0.0] * len(shown)
    kinds: list[tuple[str, Callable[[Estimate], float]]] = [
        ("params", lambda e: e.model_state.params),
        ("grads", lambda e: e.model_state.grads),
        ("grads accumulated (transient)", lambda e: e.model_state.grad_accumulation),
        ("optimizer", lambda e: e.model_state.optimizer),
        ("master", lambda e: e.model_state.master),
        ("activations", lambda e: e.activation_bytes or 0.0),
    ]
    for name, get in kinds:
        heights = [get(e) / GB for e in shown]
        ax_mem.bar(x, heights, bottom=bottom, label=name)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax_mem.axhline(plan.cluster.gpu_memory_bytes / GB, color="red", ls="--", label="capacity")
    ax_mem.set_ylabel("GB per GPU")
    ax_mem.set_title(f"{plan.model.name} on {plan.cluster.name}: memory per GPU")
    ax_mem.legend(fontsize=8)
    bottom = [0.0] * len(shown)
    times = [e.time for e in shown if e.time is not None]  # every one of shown's
    parts: list[tuple[str, Callable[[StepTime], float]]] = [
        ("compute", lambda t: t.compute_s),
        ("exposed comm", lambda t: t.exposed_comm_s),
        ("bubble", lambda t: t.bubble_s),
    ]
    for name, seconds in parts:
        heights = [seconds(t) for t in times]
        ax_time.bar(x, heights, bottom=bottom, label=name)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax_time.set_ylabel("seconds per step")
    ax_time.set_title(
        "step time: compute, exposed communication, bubble (* recommended, f fastest)"
    )
    ax_time.legend(fontsize=8)
    for ax in (ax_mem, ax_time):
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
