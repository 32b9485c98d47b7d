"""The multi-process test harness: `run_distributed(fn, k)` runs fn(rank, k, *args) in k gloo
processes forked from a warm forkserver, rendezvous through a FileStore (no ports), with a
per-test timeout and the failing rank's traceback in the error. It lives in the package
(`paratrain.bench.harness.spawn`) because the benchmarks start their ranks the same way.
"""

from paratrain.bench.harness.spawn import RankFailed
from paratrain.bench.harness.spawn import run_ranks as run_distributed

__all__ = ["RankFailed", "run_distributed"]
