"""The only module that calls torch.distributed collectives: every byte is counted here.

Strategies call these functions with a `CommGroup` taken from the Mesh; the group carries
the rank's Ledger, so what each strategy sends can be read back and compared with theory.
"""

from paratrain.comm.group import CommGroup
from paratrain.comm.ledger import Ledger, OpTotals
from paratrain.comm.ops import CommError, all_reduce, broadcast, broadcast_object

__all__ = [
    "CommError",
    "CommGroup",
    "Ledger",
    "OpTotals",
    "all_reduce",
    "broadcast",
    "broadcast_object",
]
