"""`paratrain schedule`: simulate a pipeline schedule without starting any worker.

Builds the schedule, proves it with `check_schedule` (the same object the runtime would
execute), and shows its simulated timeline as the text grid, the bubble in slots beside the
closed-form formula, the peak in-flight activations per stage, and optionally the same PNG
Gantt chart and Chrome trace a measured run produces. Useful before a run, to pick S, K
and v, and as the reference a measured timeline is compared with.
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from paratrain.config import SCHEDULES

if TYPE_CHECKING:  # the rest inside the functions: parallel.pipeline's package loads torch
    from paratrain.parallel.pipeline.check import Simulation

HELP = "simulate a pipeline schedule"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--schedule", default="1f1b", choices=list(SCHEDULES), help="schedule (default 1f1b)"
    )
    parser.add_argument(
        "--stages", "--pp", dest="stages", type=int, default=4, help="pipeline stages S"
    )
    parser.add_argument("--microbatches", type=int, default=8, help="micro-batches K per step")
    parser.add_argument(
        "--chunks",
        type=int,
        default=None,
        help="chunks v per stage (default 2 if interleaved, else 1)",
    )
    parser.add_argument(
        "--backward-cost",
        type=float,
        default=1.0,
        help="cost of one chunk-backward in forward units (BI and BW half each; default 1)",
    )
    parser.add_argument("--out", default=None, help="write the Gantt chart to this PNG")
    parser.add_argument("--trace", default=None, help="write a Chrome trace (JSON) here")
    parser.add_argument("--json", action="store_true", help="print a JSON result as last line")


def simulate(args: argparse.Namespace) -> Simulation:
    """The checked simulation of the requested schedule; ValueError on bad input."""
    from paratrain.parallel.pipeline.check import check_schedule
    from paratrain.parallel.pipeline.schedules import Costs, build_schedule

    if args.backward_cost <= 0:
        raise ValueError(f"--backward-cost {args.backward_cost}; valid: > 0")
    chunks = (
        args.chunks if args.chunks is not None else (2 if args.schedule == "interleaved" else 1)
    )
    try:
        schedule = build_schedule(args.schedule, args.stages, args.microbatches, chunks)
    except ValueError as e:  # the schedule's parameter names, said as this command's flags
        from paratrain.validate.batch_messages import schedule_in_flags

        raise ValueError(f"--schedule {args.schedule}: {schedule_in_flags(str(e))}") from None
    return check_schedule(schedule, Costs(forward=1.0, backward=args.backward_cost))


def schedule_summary(sim: Simulation) -> dict[str, Any]:
    from paratrain.plan import pipeline

    sch = sim.schedule
    s, k, v = sch.num_stages, sch.num_microbatches, sch.chunks
    formula = pipeline.bubble_fraction(s, k, v, sch.name, sim.costs.backward)
    reads = pipeline.FORMULA_READS.get(sch.name, pipeline.DEFAULT_FORMULA_READS)
    return {
        "schedule": sch.name,
        "stages": s,
        "microbatches": k,
        "chunks": v,
        "backward_cost": sim.costs.backward,
        "bubble_fraction": sim.bubble_fraction(),  # mean over stages, in slots
        "bubble_per_stage": [sim.bubble_fraction(i) for i in range(s)],
        "bubble_formula": formula,
        "formula": reads,
        "makespan_slots": sim.makespan,
        "peak_in_flight": list(sim.peak_in_flight),
    }


def run(args: argparse.Namespace) -> int:
    from paratrain.measure.chrome_trace import write_chrome_trace
    from paratrain.measure.gantt import write_gantt
    from paratrain.measure.pipeline_spans import spans_from_simulation
    from paratrain.measure.text_timeline import render_grid

    sim = simulate(args)
    result = schedule_summary(sim)
    print(render_grid(sim))
    per_stage = ", ".join(f"{b:.3f}" for b in result["bubble_per_stage"])
    print(
        f"bubble {result['bubble_fraction']:.4f} of the step in slots (per stage {per_stage}); "
        f"formula {result['formula']} = {result['bubble_formula']:.4f}"
    )
    print(f"peak in-flight activations per stage: {result['peak_in_flight']}")
    s, v = sim.schedule.num_stages, sim.schedule.chunks
    title = (
        f"{sim.schedule.name}: S={s} K={sim.schedule.num_microbatches} v={v}, "
        f"backward {sim.costs.backward:g}x forward (simulated)"
    )
    if args.out:
        spans = spans_from_simulation(sim, unit_s=1.0)
        result["out"] = str(write_gantt(spans, args.out, s, v, title, time_unit="slots"))
        print(f"Gantt chart: {result['out']}")
    if args.trace:
        # One slot as 1 ms, so Perfetto's axis reads in slots.
        trace_spans = spans_from_simulation(sim, unit_s=1e-3)
        result["trace"] = str(write_chrome_trace(trace_spans, args.trace, s, v))
        print(f"Chrome trace: {result['trace']}")
    if args.json:
        print(json.dumps(result), flush=True)
    return 0
