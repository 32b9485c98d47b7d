"""The multi-process test harness: `run_distributed(fn, k)` runs fn(rank, k, *args) in k gloo
processes forked from a warm forkserver, rendezvous through a FileStore (no ports), with a
per-test timeout and the failing rank's traceback in the error. The spawner lives in the
package (`paratrain.spawn`) because the benchmarks start their ranks the same way.

Every multi-rank test runs under NCCL's ordering rules (`CommOptions(order="nccl")`,
comm/ordering.py) unless it asks otherwise: in each rank, a `CommOptions` built without
an `order` takes "nccl", so a program that would deadlock on NCCL hangs here and is
reported (issue 28). A test that must measure gloo itself (timing, overlap) passes
`order="gloo"` and says why; options built with an explicit order keep it. A test that
runs `paratrain train` as a command passes its arguments through `under_nccl_order`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from paratrain.spawn import RankFailed, run_ranks

ORDERS = ("gloo", "nccl")


class _UnderOrder:
    """fn in a rank whose CommOptions default to `order` (picklable for the forkserver)."""

    def __init__(self, fn: Callable[..., Any], order: str) -> None:
        self.fn, self.order = fn, order

    def __call__(self, rank: int, world_size: int, *args: Any) -> Any:
        from paratrain.comm.group import CommOptions

        names = [f.name for f in dataclasses.fields(CommOptions)]
        defaults = list(CommOptions.__init__.__defaults__)
        defaults[names.index("order")] = self.order
        CommOptions.__init__.__defaults__ = tuple(defaults)  # this rank's process only
        return self.fn(rank, world_size, *args)


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, order: str = "nccl",
                    **kwargs: Any) -> list[Any]:  # fmt: skip
    """run_ranks(fn, ...) with CommOptions defaulting to `order` in every rank."""
    if order not in ORDERS:
        raise ValueError(f"order {order!r}; valid: {', '.join(ORDERS)}")
    return run_ranks(_UnderOrder(fn, order), world_size, *args, **kwargs)


def under_nccl_order(argv: Sequence[str], cwd: Path | str = ".") -> list[str]:
    """`paratrain train ...`'s arguments (run in `cwd`) with `--comm-order nccl` added where
    it has an effect (more than one process on gloo, config.EFFECTS) and no order was given;
    any other command, or one that `paratrain train` refuses (a test of the refusal), as
    given."""
    from paratrain import cli
    from paratrain.commands.config_flags import config_from_args
    from paratrain.config import EFFECTS
    from paratrain.validate import resolve_and_check

    argv = list(argv)
    if argv[:1] != ["train"] or "--comm-order" in argv:
        return argv
    try:
        # in cwd: relative paths are the command's; stderr: argparse's usage, on a refusal
        with contextlib.chdir(cwd), contextlib.redirect_stderr(io.StringIO()):
            cfg = config_from_args(cli.build_parser().parse_args(argv))
            cfg = resolve_and_check(cfg, cfg.parallel.nproc)
    except (ValueError, OSError, SystemExit):
        return argv
    if not EFFECTS["parallel.comm_order"].applies(cfg):
        return argv
    return [*argv, "--comm-order", "nccl"]


__all__ = ["RankFailed", "run_distributed", "under_nccl_order"]
