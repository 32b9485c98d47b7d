"""The only module that calls torch.distributed collectives: every byte is counted here.

Strategies call these functions with a `CommGroup` taken from the Mesh; the group carries
the rank's Ledger, its options (timeout, default algorithm, per-call checking) and the
watchdog that explains a hang. See ops.py for the collectives, p2p.py for send/recv,
ring.py and tree.py for our own algorithms, traffic.py for the byte formulas.
"""

from paratrain.comm.call import CommError, Done, Handle
from paratrain.comm.group import ALGOS, CommGroup, CommOptions
from paratrain.comm.ledger import Ledger, OpTotals
from paratrain.comm.ops import (
    all_gather,
    all_gather_flat,
    all_reduce,
    broadcast,
    reduce,
    reduce_scatter,
)
from paratrain.comm.p2p import irecv, isend, recv, recv_any, send
from paratrain.comm.report import gather_report
from paratrain.comm.rooted import barrier, broadcast_object, gather, scatter

__all__ = [
    "ALGOS",
    "CommError",
    "CommGroup",
    "CommOptions",
    "Done",
    "Handle",
    "Ledger",
    "OpTotals",
    "all_gather",
    "all_gather_flat",
    "all_reduce",
    "barrier",
    "broadcast",
    "broadcast_object",
    "gather",
    "gather_report",
    "irecv",
    "isend",
    "recv",
    "recv_any",
    "reduce",
    "reduce_scatter",
    "scatter",
    "send",
]
