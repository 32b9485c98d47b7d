"""`--straggler RANK:FACTOR`: the seeds' slow worker, reproduced on purpose.

After its step's work, that rank sleeps so the step takes FACTOR times its compute time:
what synchronous data parallelism waits for, and what the parameter server lets the
others run ahead of.
"""

from __future__ import annotations

import time

from paratrain.config import RunConfig, parse_straggler


def straggle(cfg: RunConfig, global_rank: int, world_size: int, busy_s: float) -> None:
    if not cfg.parallel.straggler:
        return
    rank, factor = parse_straggler(cfg.parallel.straggler, world_size)
    if global_rank == rank:
        time.sleep((factor - 1.0) * busy_s)
