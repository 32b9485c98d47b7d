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
algorithm. Cost models, the alpha-beta fit and busbw conventions are in comm_fit.py.
"""

from __future__ import annotations

import logging
import os
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from paratrain import comm
from paratrain.bench.comm_fit import (
    ELEMENT_BYTES,
    Fit,
    busbw_factor,
    cost,
    expected_sent,
    fit_alpha_beta,
    predictions,
)
from paratrain.comm.algos import OUR_ALGOS
from paratrain.comm.group import CommGroup, CommOptions
from paratrain.comm.ledger import Ledger
from paratrain.comm.traffic import chunk_sizes
from paratrain.config import COMM_ALGOS as ALGOS

log = logging.getLogger(__name__)

OPS = tuple(OUR_ALGOS)  # all_reduce, reduce_scatter, all_gather, broadcast, reduce
DEFAULT_SIZES = tuple(1024 * 4**i for i in range(9))  # 1 KB, 4 KB, ... 64 MB
DEFAULT_SIZES_FLAG = "1KB,4KB,16KB,64KB,256KB,1MB,4MB,16MB,64MB"
DEFAULT_WORLD_SIZES = (2, 4, 8)
MAX_WORLD = 8
UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20}
UNITS |= {"mib": 2**20, "g": 2**30, "gb": 2**30, "gib": 2**30}
INNER_BYTES = 1 << 20  # a sample is at least this many message bytes, up to MAX_INNER calls
MAX_INNER = 16
BIG_BYTES = 4 << 20  # above this, fewer samples: each already takes tens of milliseconds


def parse_size(text: str) -> int:
    """'64MB' -> 67108864. Units are binary (1 KB = 1024 bytes), as in nccl-tests."""
    match = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in UNITS:
        raise ValueError(f"message size {text!r}: expected a number with B, KB, MB or GB")
    nbytes = int(match.group(1)) * UNITS[unit]
    if nbytes <= 0 or nbytes % ELEMENT_BYTES:
        raise ValueError(
            f"message size {text!r} = {nbytes} bytes must be a positive multiple of "
            f"{ELEMENT_BYTES} (the bench sends float32)"
        )
    return nbytes


def _names(text: str, valid: tuple[str, ...], what: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    for n in names:
        if n not in valid:
            raise ValueError(f"unknown {what} {n!r}; valid: {', '.join(valid)}")
    if not names:
        raise ValueError(f"--{what}s {text!r} names no {what}")
    return names


@dataclass(frozen=True)
class Sweep:
    """What to measure. Built from the flags by `Sweep.from_flags`, which checks them."""

    ops: tuple[str, ...] = OPS
    algos: tuple[str, ...] = ALGOS
    world_sizes: tuple[int, ...] = DEFAULT_WORLD_SIZES
    sizes: tuple[int, ...] = DEFAULT_SIZES
    repeats: int = 10
    timeout_s: float = 120.0  # per collective; a hang fails with the comm layer's report

    @classmethod
    def from_flags(cls, ops: str, algos: str, world_sizes: str, sizes: str, repeats: int) -> Sweep:
        try:
            worlds = tuple(int(w) for w in world_sizes.split(","))
        except ValueError:
            raise ValueError(f"--world-sizes {world_sizes!r}: expected e.g. 2,4,8") from None
        for w in worlds:
            if not 2 <= w <= MAX_WORLD:
                raise ValueError(f"world size {w} outside 2..{MAX_WORLD}")
        if repeats < 1:
            raise ValueError(f"--repeats {repeats} must be at least 1")
        sweep = cls(
            _names(ops, OPS, "op"),
            _names(algos, ALGOS, "algo"),
            worlds,
            tuple(parse_size(s) for s in sizes.split(",")),
            repeats,
        )
        if not sweep.pairs():
            raise ValueError(
                f"no op of {', '.join(sweep.ops)} has an algorithm of {', '.join(sweep.algos)}"
            )
        return sweep

    def pairs(self) -> list[tuple[str, str]]:
        """(op, algo) pairs to run: tree only where the op has it, ring likewise."""
        return [(o, a) for o in self.ops for a in self.algos if a in OUR_ALGOS[o]]

    def samples(self, nbytes: int, oversubscribed: bool = False) -> tuple[int, int]:
        """(samples, calls per sample): fewer of both for big messages, and fewer samples
        where ranks outnumber cores (those times are not meaningful; the bytes are)."""
        inner = max(1, min(MAX_INNER, INNER_BYTES // nbytes))
        few = oversubscribed or nbytes > BIG_BYTES
        return min(self.repeats, max(3, self.repeats // 3) if few else self.repeats), inner


def _call(op: str, algo: str, nbytes: int, group: CommGroup) -> Callable[[], Any]:
    """One collective of a message of `nbytes`, on buffers allocated once, root rank 0.

    Buffers hold zeros: repeated in-place sums stay finite, and the arithmetic costs the
    same as on any other finite values.
    """
    numel = nbytes // ELEMENT_BYTES
    if op == "all_gather":  # S is the gathered size; each rank brings its chunk of it
        sizes = chunk_sizes(numel, group.size)
        mine = torch.zeros(sizes[group.rank])
        return lambda: comm.all_gather_flat(mine, group, algo=algo, sizes=sizes)
    buf = torch.zeros(numel)
    calls = {
        "all_reduce": lambda: comm.all_reduce(buf, group, algo=algo),
        "reduce_scatter": lambda: comm.reduce_scatter(buf, group, algo=algo),
        "broadcast": lambda: comm.broadcast(buf, group, src=0, algo=algo),
        "reduce": lambda: comm.reduce(buf, group, dst=0, algo=algo),
    }
    return calls[op]


def measure_rank(sweep: Sweep) -> list[dict[str, Any]]:
    """Run the sweep on this rank of the default process group; its raw measurements.

    No Mesh and no watchdog: the watchdog would publish the ledger to the store several
    times a second during timing. A hang still fails after `timeout_s`, naming the call.
    """
    ledger = Ledger()
    oversubscribed = dist.get_world_size() > usable_cores()
    group = CommGroup.world(ledger, name="bench", options=CommOptions(timeout_s=sweep.timeout_s))
    out = []
    for op, algo in sweep.pairs():
        for nbytes in sweep.sizes:
            call = _call(op, algo, nbytes, group)
            samples, inner = sweep.samples(nbytes, oversubscribed)
            ledger.reset()
            comm.barrier(group)
            call()  # warm-up: the one call whose bytes are read
            totals = ledger.totals()[(group.name, op)]
            times = []
            for _ in range(samples):
                comm.barrier(group)
                start = time.perf_counter()
                for _ in range(inner):
                    call()
                times.append((time.perf_counter() - start) / inner)
            out.append(
                {
                    "op": op,
                    "algo": algo,
                    "bytes": nbytes,
                    "times": times,
                    "inner": inner,
                    "sent": totals.bytes_sent,
                    "messages": totals.messages,
                }
            )
    return out


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


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def run_comm_bench(sweep: Sweep, out: str | None = None) -> tuple[dict[str, Any], int]:
    """Run the sweep at every world size; the JSON-ready result and the exit status.

    The status is 1 when a ring or tree measurement sent other bytes than the formula.
    """
    from paratrain.bench import comm_report as report
    from paratrain.bench.comm_ranks import run_world

    cores = usable_cores()
    results: list[dict[str, Any]] = []
    for world in sweep.world_sizes:
        start = time.perf_counter()
        rows = combine(run_world(sweep, world), world, cores)
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
    failed = [r for r in wrong if r["bytes_counted"] == "sent"]
    summary = {
        "results": results,
        "fits": [f.as_dict() for f in fits],
        "tree_vs_ring_all_reduce": preds,
        "vs_native": report.vs_native(results),
        "cores": cores,
        "bytes_mismatches": len(wrong),
        "plot": plot_path,
    }
    return summary, 1 if failed else 0
