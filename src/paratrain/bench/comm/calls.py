"""What each rank of `paratrain bench comm` runs: every collective of the sweep, timed and
counted, in one gloo process per rank.

The ranks are started by the spawner the benches and tests share (`paratrain/spawn.py`: a
forkserver with torch preloaded, a FileStore rendezvous in a fresh temporary directory,
results pickled back through a queue); a rank that fails or hangs is named in one line.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from paratrain import comm
from paratrain.bench.comm.fit import ELEMENT_BYTES
from paratrain.bench.comm.sweep import Sweep
from paratrain.comm.group import CommGroup, CommOptions
from paratrain.comm.ledger import Ledger
from paratrain.comm.traffic import chunk_sizes
from paratrain.comm.watchdog import default_store_or_none
from paratrain.measure.tcp_bytes import WireMeter, store_ports
from paratrain.spawn import RankFailed, run_ranks


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
    if op == "all_to_all":  # S is this rank's input, cut as the comm layer cuts tensors
        sizes = chunk_sizes(numel, group.size)
        send, arriving = torch.zeros(numel), [sizes[group.rank]] * group.size
        return lambda: comm.all_to_all(send, group, sizes, arriving, algo=algo)
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

    The warm-up call is also measured on the wire (measure/tcp_bytes.py: the kernel's TCP
    counters of every socket of this process but the store's, settled before and after):
    nothing else of this process sends meanwhile, so the bytes are the call's.
    """
    ledger = Ledger()
    exclude = store_ports(default_store_or_none())
    oversubscribed = dist.get_world_size() > usable_cores()
    group = CommGroup.world(ledger, name="bench", options=CommOptions(timeout_s=sweep.timeout_s))
    out = []
    for op, algo in sweep.pairs():
        for nbytes in sweep.sizes:
            call = _call(op, algo, nbytes, group)
            samples, inner = sweep.samples(nbytes, oversubscribed)
            ledger.reset()
            comm.barrier(group)
            with WireMeter(exclude) as wire:
                call()  # warm-up: the one call whose bytes are read, by the ledger and the wire
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
                    "wire": wire.acked,
                    "wire_headers": wire.header_bytes,
                }
            )
    return out


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _measure(rank: int, world: int, sweep: Sweep) -> list[dict[str, Any]]:
    return measure_rank(sweep)


def run_world(sweep: Sweep, world: int, deadline_s: float = 900.0) -> list[list[dict[str, Any]]]:
    """Start `world` rank processes, run the sweep, return each rank's measurements."""
    try:
        return run_ranks(
            _measure, world, sweep, timeout=deadline_s, collective_timeout=sweep.timeout_s
        )
    except RankFailed as e:  # "rank r of w failed:" and the traceback's last line
        lines = str(e).strip().splitlines()
        raise RuntimeError(f"{lines[0]} {lines[-1]}".strip()) from None
    except TimeoutError as e:
        raise RuntimeError(str(e)) from None
