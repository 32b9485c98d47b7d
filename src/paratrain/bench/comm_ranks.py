"""The rank processes of `paratrain bench comm`: one gloo process per rank, per world size.

Ranks are forked from a forkserver that has torch and the bench preloaded (importing torch
takes about 4 s here; forking an 8-rank world takes about a second) and rendezvous
through a FileStore in a fresh temporary directory, so no TCP port is needed. The
results come back pickled through a queue; a rank that fails is named with its error.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import time
from datetime import timedelta
from typing import Any

from paratrain.bench.comm import Sweep, measure_rank

PRELOAD = ["torch", "torch.distributed", "paratrain.bench.comm", "paratrain.bench.comm_ranks"]


def _rank_main(sweep: Sweep, rank: int, world: int, store: str, results: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # one core's worth per rank, as in training on these CPUs
    try:
        dist.init_process_group(
            "gloo",
            store=dist.FileStore(store, world),
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=sweep.timeout_s),
        )
        value = measure_rank(sweep)
        dist.destroy_process_group()
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException as e:  # reported by the parent, which names the rank
        results.put((rank, "error", f"{type(e).__name__}: {e}"))
    results.close()
    results.join_thread()
    os._exit(0)


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run_world(sweep: Sweep, world: int, deadline_s: float = 900.0) -> list[list[dict[str, Any]]]:
    """Start `world` rank processes, run the sweep, return each rank's measurements."""
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="paratrain-bench-comm-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_rank_main, args=(sweep, r, world, store, results), daemon=True)
            for r in range(world)
        ]
        for p in procs:
            p.start()
        values: dict[int, Any] = {}
        end = time.monotonic() + deadline_s
        try:
            while len(values) < world:
                if time.monotonic() > end:
                    missing = sorted(set(range(world)) - set(values))
                    raise RuntimeError(
                        f"ranks {missing} of {world} still running after {deadline_s:.0f} s"
                    )
                try:
                    rank, status, value = results.get(timeout=1.0)
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs) if r not in values and p.exitcode]
                    if dead:
                        code = procs[dead[0]].exitcode
                        raise RuntimeError(
                            f"rank {dead[0]} of {world} died (exit code {code})"
                        ) from None
                    continue
                if status != "ok":
                    raise RuntimeError(f"rank {rank} of {world} failed: {value}")
                values[rank] = pickle.loads(value)
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
    return [values[r] for r in range(world)]
