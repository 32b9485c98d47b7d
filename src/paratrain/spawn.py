"""Run a function in k processes (gloo on CPU, or NCCL with one GPU per rank): the spawner
that the benches (`bench/`: every `paratrain bench X` that starts ranks), the multi-process
tests (tests/distributed.py, tests/test_checkpoint.py) and scripts/gpu_check.py (through
tests/distributed.py) share. At
import it imports nothing from paratrain (the forkserver preloads paratrain by name, in
PRELOAD), so any package may use it.

- Ranks are forked from a forkserver that has torch and paratrain imported already, so a
  4-rank test costs about a second of start-up instead of 4 s of `import torch` per rank.
- Rendezvous is a FileStore in a fresh temporary directory: no TCP port, no port races.
- backend="nccl": rank r computes on cuda:r (`torch.cuda.set_device(r)` before joining).
- Each rank runs with one thread. A rank that raises has its traceback reported; ranks still
  running after `timeout` seconds are killed and named.
"""

from __future__ import annotations

import faulthandler
import functools
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

PRELOAD = ["torch", "torch.distributed", "paratrain", "paratrain.train.loop"]
EXITED = "paratrain/ranks_exited"  # store key: how many ranks finished their function
EXIT_WAIT_S = 30.0  # the longest a finished rank waits for the others before it exits


@functools.cache
def forkserver_context() -> Any:
    """One forkserver per process, started on first use with torch already imported: a
    process forked from it starts in milliseconds (`paratrain simulate` runs each rank so)."""
    from paratrain.comm.compat import OPTIMIZER_IMPORTS  # here: spawn.py imports no paratrain

    context = mp.get_context("forkserver")
    context.set_forkserver_preload([*PRELOAD, *OPTIMIZER_IMPORTS])
    return context


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    store_path: str,
    args: bytes,
    results: Any,
    collective_timeout: float,
    backend: str,
) -> None:
    import torch
    import torch.distributed as dist

    faulthandler.enable()  # a native crash (SIGABRT, SIGSEGV) prints where the rank was
    torch.set_num_threads(1)
    store = None
    try:
        store = dist.FileStore(store_path, world_size)
        if backend == "nccl":  # NCCL's communicators bind to the current device
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=collective_timeout),
        )
        value = fn(rank, world_size, *pickle.loads(args))
        # Plain pickle copies tensors by value; the queue's own pickler would share them
        # through file descriptors that vanish when this process exits.
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:  # report everything, including assertion errors, to the parent
        results.put((rank, "error", traceback.format_exc()))
    if store is not None:
        _wait_for_every_rank(store, world_size)
    # Leave without destroying the process group: after a deliberately failed collective
    # gloo still holds the pending work, and destroy_process_group would wait for it.
    results.close()
    results.join_thread()
    os._exit(0)


def _wait_for_every_rank(store: Any, world_size: int) -> None:
    """Leave only when every rank is done: gloo finishes connecting a pair on one side
    before the other, and a rank that exits early closes sockets a slower peer is still
    handshaking on ("Connection closed by peer"), which under load fails a correct test.
    Bounded, so a rank that never arrives (a hang test) cannot keep the others."""
    store.add(EXITED, 1)
    deadline = time.monotonic() + EXIT_WAIT_S
    while store.add(EXITED, 0) < world_size and time.monotonic() < deadline:
        time.sleep(0.01)


class RankFailed(AssertionError):
    """A rank raised or died; the message carries its traceback or exit code."""


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 600.0,
    collective_timeout: float = 300.0,
    backend: str = "gloo",
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` in world_size processes; return each rank's result.

    `fn` must be a module-level function (it is pickled by reference). Raises RankFailed
    with the first failing rank's traceback, or TimeoutError naming the ranks still running.
    """
    ctx = forkserver_context()
    tmp = tempfile.mkdtemp(prefix="paratrain-test-")
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(
                fn,
                rank,
                world_size,
                os.path.join(tmp, "store"),
                pickle.dumps(args),
                results,
                collective_timeout,
                backend,
            ),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    try:
        for p in procs:
            p.start()
        return _collect(procs, results, world_size, timeout)
    finally:
        for p in procs:
            if p.pid is None:  # never started
                continue
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        shutil.rmtree(tmp, ignore_errors=True)


def _collect(procs: list[Any], results: Any, world_size: int, timeout: float) -> list[Any]:
    deadline = time.monotonic() + timeout
    values: dict[int, Any] = {}
    while len(values) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = sorted(set(range(world_size)) - set(values))
            raise TimeoutError(f"ranks {missing} of {world_size} still running after {timeout} s")
        try:
            rank, status, value = results.get(timeout=min(remaining, 1.0))
        except queue.Empty:
            dead = [
                r for r, p in enumerate(procs) if r not in values and p.exitcode not in (None, 0)
            ]
            if dead:
                code = procs[dead[0]].exitcode
                raise RankFailed(
                    f"rank {dead[0]} of {world_size} died with exit code {code}"
                ) from None
            continue
        if status == "error":
            raise RankFailed(f"rank {rank} of {world_size} failed:\n{value}")
        values[rank] = pickle.loads(value)
    return [values[r] for r in range(world_size)]
