"""The terminal table and the PNG chart of a plan. Memory in GB (1e9 bytes), as the seeds."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from paratrain.plan.cluster import GB
from paratrain.plan.estimate import Estimate
from paratrain.plan.layout import Workload
from paratrain.plan.recommend import SYNC_VS_ASYNC, Plan
from paratrain.plan.time import StepTime

MAX_REJECTED_ROWS = 20
HEADER = (
    f"{'layout':<32} {'K':>5} {'params':>7} {'grads':>7} {'g-acc':>7} {'optim':>7} "
    f"{'master':>7} {'act':>7} {'total':>7} {'comm':>8} {'msgs':>7} {'bubble':>6} "
    f"{'step s':>9} {'days':>7} {'TFLOP/s':>8} {'MFU':>5}"
)


def _gb(x: float | None) -> str:
    return "?" if x is None else f"{x / GB:.2f}"


def _row(e: Estimate, mark: str) -> str:
    s, t = e.model_state, e.time
    k = "-" if e.microbatches is None else str(e.microbatches)
    bubble = "-" if e.bubble is None else f"{e.bubble:.0%}"
    step = "-" if t is None else f"{t.total_s:.4g}"
    days = "-" if e.train_time_s is None else f"{e.train_time_s / 86400:.3g}"
    tflops, mfu = e.model_tflops_per_gpu, e.mfu
    tflops_s = "-" if tflops is None else f"{tflops:.1f}"
    mfu_s = "-" if mfu is None else f"{mfu:.0%}"
    return (
        f"{mark + e.layout.label:<32} {k:>5} {_gb(s.params):>7} {_gb(s.grads):>7} "
        f"{_gb(s.grad_accumulation):>7} {_gb(s.optimizer):>7} {_gb(s.master):>7} "
        f"{_gb(e.activation_bytes):>7} "
        f"{_gb(e.memory_bytes):>7} {_gb(e.comm_bytes):>8} {e.messages:>7} {bubble:>6} "
        f"{step:>9} {days:>7} {tflops_s:>8} {mfu_s:>5}"
    )


def _zero2_side(e: Estimate) -> str:
    s = e.model_state
    acc = f" + {_gb(s.grad_accumulation)} accumulating" if s.grad_accumulation else ""
    return (
        f"{e.zero2_accumulate}: grads {_gb(s.grads)}{acc}, gradient traffic "
        f"{_gb(e.gradient_comm_bytes)} GB/step, total {_gb(e.memory_bytes)} GB"
    )


def zero2_note(e: Estimate) -> str | None:
    """Both ZeRO-2 accumulation options of a layout with K > 1: the charged one first."""
    alt = e.alternative
    if alt is None:
        return None
    step = "" if alt.time is None else f", step {alt.time.total_s:.4g} s"
    over = alt.memory_bytes > alt.capacity_bytes
    verdict = "fits" if alt.fits else "over capacity" if over else "rejected"
    return (
        f"    ZeRO-2, K = {e.microbatches}, {_zero2_side(e)} (charged) | "
        f"{_zero2_side(alt)}{step}, {verdict}"
    )


def zero2_assumption(w: Workload) -> str:
    """One line: which ZeRO-2 accumulation the table charges, and its model state in N."""
    p = w.precision
    sharded = w.state_bytes_per_param - p.param_bytes  # 14 for mixed-precision Adam
    state = f"{p.param_bytes}N + {sharded}N/k bytes of model state ({p.name} {w.optimizer})"
    if w.zero2_accumulate == "shard":
        return (
            "ZeRO-2 assumes gradients reduce-scattered into the 1/k shard after every "
            f"micro-batch (--zero2-accumulate shard, as DeepSpeed): {state}, K x the gradient "
            "traffic; --zero2-accumulate full would hold the whole gradient instead"
        )
    return (
        "ZeRO-2 assumes the whole gradient held until the last micro-batch, one reduce-scatter "
        f"(--zero2-accumulate full): {state} plus {p.grad_bytes}N (g-acc) while accumulating "
        "K > 1 micro-batches; --zero2-accumulate shard (the default) does not hold it"
    )


def table(plan: Plan) -> str:
    """Fitting layouts (recommended marked *), then rejected ones with their reasons."""
    m, c, w = plan.model, plan.cluster, plan.workload
    lines = [
        f"model {m.name}: N = {m.params:.4g} parameters"
        + (f", {m.n_layer} layers, hidden {m.d_model}, {m.n_head} heads" if m.has_shape else "")
        + f", seq {m.seq_len}; {w.precision.name} precision, {w.optimizer}: "
        f"{w.state_bytes_per_param} bytes/param; recompute {w.recompute}",
        f"cluster {c.name}: {c.gpus} GPUs, {c.gpus_per_node} per node, "
        f"{c.gpu_memory_bytes / GB:.0f} GB each, intra {c.intra_bw / GB:.0f} GB/s, "
        f"inter {c.inter_bw / GB:.0f} GB/s, {c.effective_flops:.3g} FLOP/s effective",
        "GB per GPU (1e9 bytes); g-acc = the whole gradient ZeRO-2 holds while accumulating "
        "with --zero2-accumulate full; comm = GB sent per GPU per step; days to train "
        f"{w.train_tokens:.3g} tokens; TFLOP/s = model FLOPs per GPU over the step, MFU = "
        "that over peak",
        *([zero2_assumption(w)] if any(e.layout.zero == 2 for e in plan.estimates) else []),
        "",
        HEADER,
    ]
    fitting = sorted((e for e in plan.estimates if e.fits), key=lambda e: e.memory_bytes)
    for e in fitting:
        lines.append(_row(e, "* " if e is plan.recommended else "  "))
        lines += [n for n in [zero2_note(e)] if n]
    rejected = [e for e in plan.estimates if not e.fits]
    if rejected:
        lines += ["", f"rejected ({len(rejected)}):"]
        for e in rejected[:MAX_REJECTED_ROWS]:
            lines.append(f"  {e.layout.label:<30} {e.reason}")
            lines += [n for n in [zero2_note(e)] if n]
        if len(rejected) > MAX_REJECTED_ROWS:
            lines.append(f"  ... and {len(rejected) - MAX_REJECTED_ROWS} more (see --json)")
    lines += ["", plan.explanation]
    lines += [f"warning: {x}" for x in plan.warnings]
    lines += ["", SYNC_VS_ASYNC]
    return "\n".join(lines)


def chart(plan: Plan, path: str | Path, max_layouts: int = 24) -> Path:
    """Two panels: memory per GPU stacked by kind against capacity; step time by part."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [e for e in plan.estimates if e.time is not None]
    shown.sort(key=lambda e: (not e.fits, e.memory_bytes))
    shown = shown[:max_layouts]
    # "*" marks the recommendation, "x" a rejected layout (it may fit in memory but not run).
    labels = [
        ("* " if e is plan.recommended else "" if e.fits else "x ") + e.layout.label for e in shown
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
    ax_time.set_title("step time: compute, exposed communication, bubble (fitting layouts first)")
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
