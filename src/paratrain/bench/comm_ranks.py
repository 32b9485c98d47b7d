"""The rank processes of `paratrain bench comm`: one gloo process per rank, per world size.

They are started by the benches' shared harness (`bench/ranks.py`: a forkserver with
torch preloaded, a FileStore rendezvous in a fresh temporary directory, results pickled
back through a queue); a rank that fails or hangs is named in one line.
"""

from __future__ import annotations

from typing import Any

from paratrain.bench.comm import Sweep, measure_rank
from paratrain.bench.ranks import RankFailed, run_ranks


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
