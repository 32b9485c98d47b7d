"""The only package that calls torch.distributed collectives: every byte is counted here.

Strategies call these functions with a `CommGroup` taken from the Mesh; the group carries
the rank's Ledger, its options (timeout, default algorithm, per-call checking) and the
watchdog that explains a hang. A call flows: op (in_place.py: all_reduce, broadcast,
reduce; sharded.py: all_gather, reduce_scatter; all_to_all.py; rooted.py; p2p.py:
send/recv) -> algos.py picks native or ours (ring.py, tree.py; all_to_all.py's pairwise
exchange) -> call.py records it in the ledger (same_call.py optionally verifies that every
rank makes the same call) -> wait.py waits, bounded, or raises CommError with the
watchdog's report -> the ledger counts the bytes of traffic.py's formulas (native) or of
what was sent (ours); report.py gathers every rank's counters.
"""

from paratrain.comm.all_to_all import all_to_all
from paratrain.comm.call import Done, Handle, Pending
from paratrain.comm.group import CommGroup, CommOptions
from paratrain.comm.in_place import all_reduce, broadcast, reduce
from paratrain.comm.ledger import Ledger, OpTotals
from paratrain.comm.p2p import irecv, isend, post, recv, recv_any, send, sendrecv
from paratrain.comm.report import gather_report
from paratrain.comm.rooted import barrier, broadcast_object, gather, scatter
from paratrain.comm.sharded import all_gather, all_gather_flat, reduce_scatter
from paratrain.comm.wait import CommError

__all__ = [
    "CommError",
    "CommGroup",
    "CommOptions",
    "Done",
    "Handle",
    "Ledger",
    "OpTotals",
    "Pending",
    "all_gather",
    "all_gather_flat",
    "all_reduce",
    "all_to_all",
    "barrier",
    "broadcast",
    "broadcast_object",
    "gather",
    "gather_report",
    "irecv",
    "isend",
    "post",
    "recv",
    "recv_any",
    "reduce",
    "reduce_scatter",
    "scatter",
    "send",
    "sendrecv",
]
