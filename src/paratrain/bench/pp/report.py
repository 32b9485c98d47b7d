"""`paratrain bench pp`'s report: per schedule, the loss check, the ratio of the slower
ranks' times, our measured bubble beside the simulated one and the formula, the Gantt
chart and Chrome trace of the last pair, and the closing table."""

from __future__ import annotations

import logging
import statistics
from pathlib import Path
from typing import Any

from paratrain.bench.harness.pairs import check_losses, ratio_summary
from paratrain.bench.pp.peer import PEER
from paratrain.measure.chrome_trace import write_chrome_trace
from paratrain.measure.gantt import write_gantt
from paratrain.measure.pipeline_spans import spans_from_traces
from paratrain.parallel.pipeline import Costs, build_schedule, check_schedule
from paratrain.plan.pipeline import bubble_fraction

log = logging.getLogger(__name__)
# Same weights, batches and arithmetic up to the order of float32 additions (torch divides
# the accumulated gradient by K, ours each micro-batch's loss), amplified a little by AdamW:
# the bound and why it holds, bench/harness/pairs.py.
LOSS_RTOL = 1e-4


def summarise(name: str, k: int, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One schedule's entry of the JSON result from every rank's rows."""
    world, v = len(per_rank), PEER[name][1]
    last = per_rank[-1]  # the last stage holds the loss on both sides
    losses = [last["warmup_losses"]] + [(r.ours_loss, r.peer_loss) for r in last["rows"]]
    worst = check_losses([o for o, _ in losses], [p for _, p in losses], LOSS_RTOL, f"{name}: ")
    # A pipeline step ends when its slowest stage ends: per pair, the slower rank's time.
    pairs = range(len(last["rows"]))
    ours = [max(r["rows"][i].ours_s for r in per_rank) for i in pairs]
    peer = [max(r["rows"][i].peer_s for r in per_rank) for i in pairs]
    bubbles = [statistics.median(r["bubbles"]) for r in per_rank]
    sim = check_schedule(build_schedule(name, world, k, v), Costs(forward=1.0, backward=2.0))
    return {
        "schedule": name,
        "peer": PEER[name][0],
        "stages": world,
        "chunks": v,
        "microbatches": k,
        "micro_batch": last["micro_batch"],
        **ratio_summary(ours, peer),
        "bubble_measured": statistics.fmean(bubbles),
        "bubble_measured_per_stage": bubbles,
        "bubble_simulated": sim.bubble_fraction(),  # backward = 2 x forward
        "bubble_formula": bubble_fraction(world, k, v, name, backward=2.0),
        "peak_in_flight": [r["peak_in_flight"] for r in per_rank],
        "peak_in_flight_simulated": list(sim.peak_in_flight),
        "max_loss_rel_diff": worst,
    }


def draw(entry: dict[str, Any], per_rank: list[dict[str, Any]], out: Path) -> None:
    """The last pair's Gantt chart (PNG) and Chrome trace, paths added to `entry`."""
    world = entry["stages"]
    traces = [r["trace"] for r in per_rank]
    spans = spans_from_traces(traces)
    title = (
        f"{entry['schedule']} (ours, measured): S={world} K={entry['microbatches']} "
        f"v={entry['chunks']}, last of {entry['pairs']} pairs"
    )
    idle = [t.bubble_fraction() for t in traces]
    png = out / f"pp-{entry['schedule']}.png"
    entry["gantt"] = str(write_gantt(spans, png, world, entry["chunks"], title, idle))
    with_comm = spans_from_traces(traces, include_comm=True)
    trace_path = out / f"pp-{entry['schedule']}.trace.json"
    entry["trace"] = str(write_chrome_trace(with_comm, trace_path, world, entry["chunks"]))


def log_entry(e: dict[str, Any]) -> None:
    log.info(
        "%s: median step ours %.4f s, torch %.4f s; ratio %.3f (IQR %.3f-%.3f, range "
        "%.3f-%.3f, %d pairs); bubble measured %s (simulated %.3f, formula %.3f); peak "
        "in-flight %s; losses agree to %.1e",
        e["schedule"], e["ours_step_s"], e["torch_step_s"], e["ratio"], e["ratio_q1"],
        e["ratio_q3"], e["ratio_min"], e["ratio_max"], e["pairs"],
        [round(b, 3) for b in e["bubble_measured_per_stage"]], e["bubble_simulated"],
        e["bubble_formula"], e["peak_in_flight"], e["max_loss_rel_diff"],
    )  # fmt: skip


def schedules_table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| schedule | torch peer | ours (s) | torch (s) | ratio [IQR] | bubble measured "
        "| simulated | peak in-flight |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for e in results:
        lines.append(
            f"| {e['schedule']} | {e['peer']} | {e['ours_step_s']:.4f} | "
            f"{e['torch_step_s']:.4f} | {e['ratio']:.3f} [{e['ratio_q1']:.3f}-"
            f"{e['ratio_q3']:.3f}] | {e['bubble_measured']:.3f} | {e['bubble_simulated']:.3f} "
            f"| {e['peak_in_flight']} |"
        )
    return "\n".join(lines)
