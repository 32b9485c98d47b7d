"""`paratrain bench comm`: native, ring and tree collectives timed and counted side by side.

For each world size, k real processes (gloo on CPU, one thread each) run the whole sweep:
for every (op, algorithm, message size), one warm-up call whose bytes are read from the
ledger, then `repeats` timed samples (a third of them, at least 3, for messages over
4 MB and for oversubscribed worlds). A sample starts after a barrier and times `inner`
back-to-back calls (many for small messages, whose single-call time is near the timer's
and the barrier's skew, as nccl-tests does with its iterations); its time is the slowest
rank's, and the reported time is the median sample. Bytes sent per rank are compared with
`paratrain.comm.traffic`: for ring and tree the ledger counts what was really sent, so a
difference is a bug and the bench exits non-zero; for native the ledger records the
formula itself, so agreement there is by construction.

Ranks start from a forkserver with torch preloaded and meet through a FileStore in a
temporary directory: no port, and a world of 8 starts in about a second. Times taken with
more ranks than cores are marked oversubscribed: they measure the scheduler, not the
algorithm. The flags become a `Sweep` (sweep.py); each rank's calls are in calls.py; cost
models, the alpha-beta fit and busbw conventions in fit.py; tables and the plot in report.py.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any

from paratrain.bench.comm import calls, report, wire
from paratrain.bench.comm.fit import (
    Fit,
    busbw_factor,
    cost,
    expected_sent,
    fit_alpha_beta,
    predictions,
)
from paratrain.bench.comm.sweep import Sweep

log = logging.getLogger(__name__)


def combine(per_rank: list[list[dict[str, Any]]], world: int, cores: int) -> list[dict[str, Any]]:
    """One result per measurement: slowest rank per sample, median sample, bytes by rank."""
    out = []
    for entries in zip(*per_rank, strict=True):
        first = entries[0]
        op, algo, nbytes = first["op"], first["algo"], first["bytes"]
        samples = [max(ts) for ts in zip(*(e["times"] for e in entries), strict=True)]
        t = statistics.median(samples)
        algbw = nbytes / t / 1e9
        sent = [e["sent"] for e in entries]
        expected = expected_sent(op, algo, nbytes, world)
        out.append(
            {
                "op": op,
                "algo": algo,
                "world_size": world,
                "bytes": nbytes,
                "time_s": t,
                "time_min_s": min(samples),
                "algbw_gbps": algbw,
                "busbw_gbps": algbw * busbw_factor(op, world),
                "sent_bytes_per_rank": sent,
                "expected_sent_bytes_per_rank": expected,
                "bytes_match": sent == expected,
                "bytes_counted": "formula" if algo == "native" else "sent",
                "messages_per_rank": [e["messages"] for e in entries],
                "wire_sent_bytes_per_rank": [e["wire"] for e in entries],
                "wire_tcp_header_bytes_per_rank": [e["wire_headers"] for e in entries],
                **wire.compare(op, algo, nbytes, world, [e["wire"] for e in entries]),
                "steps": cost(op, algo, world).steps,
                "samples": len(samples),
                "calls_per_sample": first["inner"],
                "oversubscribed": world > cores,
            }
        )
    return out


def fit_all(results: list[dict[str, Any]]) -> list[Fit]:
    """An alpha-beta fit per (op, algo), on times not oversubscribed where there are any.

    Skipped where the sweep gives fewer than two distinct points to fit two unknowns.
    """
    fits = []
    for op, algo in dict.fromkeys((r["op"], r["algo"]) for r in results):
        mine = [r for r in results if (r["op"], r["algo"]) == (op, algo)]
        clean = [r for r in mine if not r["oversubscribed"]]
        points = [(r["world_size"], r["bytes"], r["time_s"]) for r in (clean or mine)]
        if len({(k, n) for k, n, _ in points}) < 2:  # two unknowns need two sizes
            continue
        fits.append(fit_alpha_beta(op, algo, points, oversubscribed=not clean))
    return fits


def run_comm_bench(sweep: Sweep, out: str | None = None) -> tuple[dict[str, Any], int]:
    """Run the sweep at every world size; the JSON-ready result and the exit status.

    The status is 1 when a ring or tree measurement sent other bytes than the formula, or
    when the bytes on the wire fall outside gloo's model (bench/comm/wire.py) plus its
    preambles.
    """
    cores = calls.usable_cores()
    results: list[dict[str, Any]] = []
    for world in sweep.world_sizes:
        start = time.perf_counter()
        rows = combine(calls.run_world(sweep, world), world, cores)
        note = f"oversubscribed: {world} ranks on {cores} cores" if world > cores else "timed"
        log.info("world size %d (%s), %.1f s", world, note, time.perf_counter() - start)
        log.info("%s", report.format_table(rows))
        results += rows
    fits = fit_all(results)
    preds = predictions(fits)
    if fits:
        log.info("alpha-beta fits, T = steps * alpha + bytes * beta:\n%s", report.format_fits(fits))
    if preds:
        log.info("%s", report.format_predictions(preds))
    plot_path = str(report.plot(results, fits, out)) if out else None
    if plot_path:
        log.info("plot: %s", plot_path)
    wrong, off_wire = log_mismatches(results)
    failed = [r for r in wrong if r["bytes_counted"] == "sent"] + off_wire
    summary = {
        "results": results,
        "fits": [f.as_dict() for f in fits],
        "tree_vs_ring_all_reduce": preds,
        "vs_native": report.vs_native(results),
        "cores": cores,
        "bytes_mismatches": len(wrong),
        "wire_mismatches": len(off_wire),
        "plot": plot_path,
    }
    return summary, 1 if failed else 0


def log_mismatches(
    results: list[dict[str, Any]],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Log and return the rows whose counted bytes differ from the formula, and those whose
    bytes on the wire fall outside gloo's model."""
    wrong = [r for r in results if not r["bytes_match"]]
    for r in wrong:
        log.error(
            "%s(%s) of %d bytes on %d ranks sent %s bytes per rank; the formula says %s",
            r["op"],
            r["algo"],
            r["bytes"],
            r["world_size"],
            r["sent_bytes_per_rank"],
            r["expected_sent_bytes_per_rank"],
        )
    off_wire = [r for r in results if not r["wire_match"]]
    for r in off_wire:
        log.error(
            "%s(%s) of %d bytes on %d ranks put %s bytes per rank on the wire; gloo's model "
            "says %s plus at most %d of preambles",
            r["op"],
            r["algo"],
            r["bytes"],
            r["world_size"],
            r["wire_sent_bytes_per_rank"],
            r["wire_model_bytes_per_rank"],
            wire.slack(r["bytes"]),
        )
    return wrong, off_wire
