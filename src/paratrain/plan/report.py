"""The terminal table of a plan: the recommendation and the fastest layout first, then the
best layouts by --sort (every one with --all). Memory in GB (1e9 bytes), as the seeds.
The chart is chart.py."""

from __future__ import annotations

from paratrain.plan.cluster import GB
from paratrain.plan.estimate import Estimate
from paratrain.plan.layout import Workload
from paratrain.plan.recommend import SYNC_VS_ASYNC, Plan
from paratrain.plan.summary import DEFAULT_ROWS, recommendation_lines, shown_rows

HEADER = (
    f"{'layout':<34} {'K':>5} {'params':>7} {'grads':>7} {'g-acc':>7} {'optim':>7} "
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
        f"{mark + e.layout.label:<34} {k:>5} {_gb(s.params):>7} {_gb(s.grads):>7} "
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


def _inputs(plan: Plan) -> list[str]:
    """The model, the cluster (its datasheet peak and calibrated efficiency apart) and the
    columns' units."""
    m, c, w = plan.model, plan.cluster, plan.workload
    return [
        f"model {m.name}: N = {m.params:.4g} parameters"
        + (f", {m.n_layer} layers, hidden {m.d_model}, {m.n_head} heads" if m.has_shape else "")
        + f", seq {m.seq_len}; {w.precision.name} precision, {w.optimizer}: "
        f"{w.state_bytes_per_param} bytes/param; recompute {w.recompute}",
        f"cluster {c.name}: {c.gpus} GPUs, {c.gpus_per_node} per node, "
        f"{c.gpu_memory_bytes / GB:.0f} GB each, intra {c.intra_bw / GB:.0f} GB/s, "
        f"inter {c.inter_bw / GB:.0f} GB/s; peak {c.mfu_peak_flops / 1e12:.0f} TFLOP/s per "
        f"GPU (datasheet), efficiency {c.efficiency:.0%} (calibrated) = "
        f"{c.effective_flops:.3g} FLOP/s effective",
        "GB per GPU (1e9 bytes); g-acc = the whole gradient ZeRO-2 holds while accumulating "
        "with --zero2-accumulate full; comm = GB sent per GPU per step; days to train "
        f"{w.train_tokens:.3g} tokens; TFLOP/s = model FLOPs per GPU over the step, MFU = "
        "that over the datasheet peak",
        *([zero2_assumption(w)] if any(e.layout.zero == 2 for e in plan.estimates) else []),
    ]


def table(plan: Plan, sort: str = "time", show_all: bool = False) -> str:
    """The recommendation and the fastest layout, then fitting layouts by `sort` (the
    recommended one first, marked *): DEFAULT_ROWS of them, or with show_all every one and
    the rejected ones with their reasons."""
    rows = shown_rows(plan, sort, show_all)
    fitting = [e for e in plan.estimates if e.fits]
    rejected = [e for e in plan.estimates if not e.fits]
    lines = [*recommendation_lines(plan), "", *_inputs(plan), "", HEADER]
    for e in rows:
        lines.append(_row(e, "* " if e is plan.recommended else "  "))
        lines += [n for n in [zero2_note(e)] if n]
    hidden = len(fitting) - len(rows)
    if not show_all and (hidden > 0 or rejected):
        more = f"{hidden} more fitting, " if hidden > 0 else ""
        lines.append(
            f"({len(rows)} of {len(fitting)} fitting layouts by {sort}; {more}"
            f"{len(rejected)} rejected: --all lists them with their reasons)"
        )
    if rejected and (show_all or not fitting):
        shown = rejected if show_all else rejected[:DEFAULT_ROWS]
        lines += ["", f"rejected ({len(rejected)}):"]
        for e in shown:
            lines.append(f"  {e.layout.label:<30} {e.reason}")
            lines += [n for n in [zero2_note(e)] if n]
    lines += ["", plan.explanation]
    lines += [f"warning: {x}" for x in plan.warnings]
    if show_all:
        lines += ["", SYNC_VS_ASYNC]
    return "\n".join(lines)
