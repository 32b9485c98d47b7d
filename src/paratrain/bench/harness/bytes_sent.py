"""Bytes each side of a comparison sends per rank, by op, in one shape: ours from our
ledger (`ours_by_op`), a PyTorch peer's counted at the dispatcher (`PeerTraffic`) and sized
as our ledger sizes ours.

DDP's reducer, ZeroRedundancyOptimizer and FSDP2 issue `c10d` ops; DTensor (FSDP2's
gradient norm, tensor parallelism) issues functional collectives (`_c10d_functional`).
Each call's message size S goes through `native_traffic`, the ring and chain formulas our
ledger uses for native collectives (comm/traffic.py), so both sides are counted alike;
our ledger itself never sees the peer's calls. All the peers' collectives here run on
the world group.
"""

from __future__ import annotations

from paratrain.comm import compat
from paratrain.comm.ledger import Ledger
from paratrain.comm.traffic import native_traffic

# (namespace, op) -> (our op, index of the argument holding the tensor(s), whether that
# argument is one rank's chunk of S rather than S, index of the root argument)
COLLECTIVES = {
    ("c10d", "allreduce_"): ("all_reduce", 0, False, None),
    ("c10d", "broadcast_"): ("broadcast", 0, False, 2),
    ("c10d", "_allgather_base_"): ("all_gather", 0, False, None),  # (output, input): S out
    ("c10d", "_reduce_scatter_base_"): ("reduce_scatter", 1, False, None),  # S: the input
    ("_c10d_functional", "all_reduce"): ("all_reduce", 0, False, None),
    ("_c10d_functional", "all_gather_into_tensor"): ("all_gather", 0, True, None),
    ("_c10d_functional", "reduce_scatter_tensor"): ("reduce_scatter", 0, False, None),
}
NOT_SENDING = {"wait_tensor", "_wrap_tensor_autograd"}  # functional bookkeeping, no message


def call_size(namespace: str, name: str, args: tuple, group_size: int) -> tuple[str, int, int]:
    """(our op, S in bytes, root) of one collective call; KeyError if it is not sized."""
    op, arg, is_chunk, root_arg = COLLECTIVES[(namespace, name)]
    tensors = args[arg] if isinstance(args[arg], list | tuple) else [args[arg]]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    root = args[root_arg] if root_arg is not None else 0
    return op, nbytes * (group_size if is_chunk else 1), root


class PeerTraffic(compat.TorchDispatchMode):
    """Bytes this rank sends in the peer's collectives while the mode is active, by op.

    `sent`: {op: bytes}; `unsized`: {op: calls} of any other collective (none for these
    peers). Modes nest: a PeerTraffic inside another counts a part of the step again.
    """

    def __init__(self, group_size: int, rank: int) -> None:
        super().__init__()
        self.group_size, self.rank = group_size, rank
        self.sent: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self.unsized: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        from torch.distributed.tensor import DTensor

        if isinstance(func, compat.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor desugar into plain ops first
        out = func(*args, **(kwargs or {}))
        if func.namespace in ("c10d", "_c10d_functional"):
            self._record(func.namespace, func.overloadpacket.__name__, args)
        return out

    def _record(self, namespace: str, name: str, args: tuple) -> None:
        if name in NOT_SENDING:
            return
        if (namespace, name) not in COLLECTIVES:
            self.unsized[name] = self.unsized.get(name, 0) + 1
            return
        op, nbytes, root = call_size(namespace, name, args, self.group_size)
        sent = native_traffic(op, nbytes, self.group_size, self.rank, root).sent
        self.sent[op] = self.sent.get(op, 0) + sent
        self.calls[op] = self.calls.get(op, 0) + 1

    def bytes_sent(self) -> int:
        return sum(self.sent.values())

    def summary(self) -> dict[str, dict[str, int]]:
        """{op: {calls, bytes_sent}} for this rank, like our ledger's totals."""
        out = {
            op: {"calls": self.calls[op], "bytes_sent": self.sent[op]} for op in sorted(self.sent)
        }
        for name, n in self.unsized.items():
            out[name] = {"calls": n, "bytes_sent": 0}
        return out


def ours_by_op(ledger: Ledger) -> dict[str, dict[str, int]]:
    """{op: {calls, bytes_sent}} of everything our ledger recorded, over all groups."""
    out: dict[str, dict[str, int]] = {}
    for (_, op), totals in sorted(ledger.totals().items()):
        entry = out.setdefault(op, {"calls": 0, "bytes_sent": 0})
        entry["calls"] += int(totals.calls)
        entry["bytes_sent"] += int(totals.bytes_sent)
    return out
