"""Context parallelism: the sequence split across a group of ranks, for attention.

Every layer but attention works token by token, so each rank runs it on its own tokens;
attention needs every key, and two ways bring them (docs/context-parallel.md):

    layout.py   which tokens each rank holds (plain, or load-balanced for causal masks)
    blocks.py   attention of one block with its log-sum-exp, the merge rule, its backward
    ring.py     ring attention: keys and values travel around the group (send/recv)
    ulysses.py  all-to-all attention: heads travel instead (two all-to-alls)
    apply.py    a plain model made context parallel from outside; a rank's tokens of a batch

Its costs as formulas (messages, bytes, FLOPs per rank) are the planner's:
plan/context_cost.py.

Every function takes the context-parallel `group` explicitly; all traffic goes through comm.
"""

from paratrain.parallel.context_parallel.apply import (
    METHODS,
    TokenShard,
    apply_context_parallel,
)
from paratrain.parallel.context_parallel.layout import inverse, permutation, positions, shard
from paratrain.parallel.context_parallel.ring import ring_attention
from paratrain.parallel.context_parallel.ulysses import ulysses_attention

__all__ = [
    "METHODS",
    "TokenShard",
    "apply_context_parallel",
    "inverse",
    "permutation",
    "positions",
    "ring_attention",
    "shard",
    "ulysses_attention",
]
