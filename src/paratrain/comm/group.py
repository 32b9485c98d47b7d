"""A process group with a name, its member ranks, its options and the ledger that counts it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from paratrain.comm.ledger import Ledger
from paratrain.comm.progress import ProgressThread
from paratrain.comm.streams import Streams
from paratrain.config import COMM_ALGOS, COMM_ORDERS

if TYPE_CHECKING:
    from paratrain.comm.watchdog import Watchdog


@dataclass(frozen=True)
class CommOptions:
    timeout_s: float = 300.0  # a collective not completed by then fails with a report
    algo: str = "native"  # default algorithm where a call does not choose one
    check: bool = False  # verify before each call that all ranks issue the same op/shapes
    # False: every asynchronous collective completes before it returns. The baseline that
    # the overlap measurements compare with (tests/test_overlap.py, `bench overlap`).
    overlap: bool = True
    # Each message step takes at least this long: a slower network simulated on one
    # machine, so that communication is long enough to time and, as on a real link, costs
    # waiting rather than CPU. For measurements only; 0 in training.
    link_latency_s: float = 0.0
    # And each byte sent at most this fast (0: no limit): a slow link's bandwidth, on a
    # group that crosses it (`paratrain bench diloco` slows the one between replica groups)
    link_bandwidth_Bps: float = 0.0
    # "nccl": every call waits its turn as ProcessGroupNCCL would order it, on gloo, so
    # that a program that would deadlock on GPUs deadlocks here too and is reported
    # (comm/ordering.py). Tests ask for it with CommOptions(order="nccl").
    order: str = "gloo"

    def __post_init__(self) -> None:
        if self.algo not in COMM_ALGOS:
            raise ValueError(f"comm algo {self.algo!r}; valid: {', '.join(COMM_ALGOS)}")
        if self.timeout_s <= 0:
            raise ValueError(f"comm timeout {self.timeout_s} s must be positive")
        if self.order not in COMM_ORDERS:
            raise ValueError(f"comm order {self.order!r}; valid: {', '.join(COMM_ORDERS)}")
        if self.link_latency_s < 0:
            raise ValueError(f"link latency {self.link_latency_s} s must be >= 0")
        if self.link_bandwidth_Bps < 0:
            raise ValueError(f"link bandwidth {self.link_bandwidth_Bps} B/s must be >= 0")


def backend_of(pg: dist.ProcessGroup) -> str:
    """The backend's name; also for a process group made outside the default world (fault
    tolerance's groups across replica groups), which torch.distributed does not list."""
    try:
        return str(dist.get_backend(pg))
    except (ValueError, RuntimeError):
        return str(pg.name())


class CommGroup:
    """`rank` is this process's rank within the group; `ranks[i]` is group rank i's global rank.

    `pg` is None for a group of one rank, where every collective is a local no-op.
    """

    def __init__(
        self,
        name: str,
        pg: dist.ProcessGroup | None,
        ranks: list[int],
        global_rank: int,
        ledger: Ledger,
        options: CommOptions | None = None,
        watchdog: Watchdog | None = None,
    ) -> None:
        if global_rank not in ranks:
            raise ValueError(f"rank {global_rank} is not in group {name} {ranks}")
        self.name = name
        self.pg = pg
        self.ranks = list(ranks)
        self.global_rank = global_rank
        self.rank = self.ranks.index(global_rank)
        self.ledger = ledger
        self.options = options or CommOptions()
        self.watchdog = watchdog
        # NCCL queues its work on a CUDA stream and returns at once: waiting and timing
        # must synchronise with the device (wait.py), and its tensors live on the GPU.
        self.asynchronous_to_host = pg is not None and backend_of(pg) == "nccl"
        if self.asynchronous_to_host and self.options.order == "nccl":
            raise ValueError(
                f"comm order nccl on group {name!r}, whose backend is NCCL: NCCL orders its "
                "calls itself; the order is for gloo groups"
            )
        self._progress: ProgressThread | None = None
        self._streams: Streams | None = None
        self.link_free_at = 0.0  # the simulated slower network's queue (wait.py)
        self._scratch: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    @property
    def progress(self) -> ProgressThread:
        """The thread that runs this group's calls of our algorithms (progress.py), started
        on first use: groups that only use native collectives never have one."""
        if self._progress is None:
            self._progress = ProgressThread(self.name, self.device)
        return self._progress

    @property
    def streams(self) -> Streams:
        """Under NCCL's order, the streams this group's calls wait their turn on
        (ordering.py), created on first use."""
        if self._streams is None:
            self._streams = Streams(self.name, self.rank, self.ranks)
        return self._streams

    def share_streams(self, other: CommGroup) -> None:
        """Take turns on `other`'s streams: both groups run over one process group."""
        if other.pg is not self.pg:
            raise ValueError(f"groups {self.name} and {other.name} have different process groups")
        self._streams = other.streams
        self._streams.also_serve(self.name)

    @classmethod
    def world(
        cls,
        ledger: Ledger,
        name: str = "world",
        options: CommOptions | None = None,
        watchdog: Watchdog | None = None,
    ) -> CommGroup:
        if not dist.is_initialized():
            return cls(name, None, [0], 0, ledger, options, watchdog)
        size = dist.get_world_size()
        pg = dist.group.WORLD if size > 1 else None
        return cls(name, pg, list(range(size)), dist.get_rank(), ledger, options, watchdog)

    def scratch(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A buffer our algorithms receive into, kept between calls: one of them runs at a
        time per group (progress.py), and a fresh allocation per call costs page faults on
        large messages. It keeps the largest message chunk this group has received."""
        buffer = self._scratch.get((dtype, device))
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=dtype, device=device)
            self._scratch[(dtype, device)] = buffer
        return buffer[:numel]

    @property
    def device(self) -> torch.device:
        """Where this group's backend takes tensors that no caller handed in (the per-call
        check's): the current GPU under NCCL, the host under gloo."""
        if self.asynchronous_to_host:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @property
    def size(self) -> int:
        return len(self.ranks)

    def alone(self, name: str) -> CommGroup:
        """This rank by itself (every collective a local no-op), counted in the same ledger:
        for a model without tensor parallelism, a worker's own replica, the server."""
        return CommGroup(
            name, None, [self.global_rank], self.global_rank, self.ledger, self.options
        )

    def to_global(self, rank: int) -> int:
        """The one place where a rank within the group becomes a global rank."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} outside group {self.name} of size {self.size}")
        return self.ranks[rank]

    def __repr__(self) -> str:
        return f"CommGroup({self.name}, rank {self.rank}/{self.size}, ranks={self.ranks})"
