"""A weight tied between the two ends of a pipeline (the token table and the head), under
ZeRO: what its sum across the ends costs within each end's data-parallel group.

The ends keep the table in different flat layouts, so the runtime sums it through whole
tensors (parallel/data_parallel/sharded_replica.py `_all_reduce_whole`): each end puts its
pieces of the gradient in place in a zero-filled whole, all-reduces it over the two ends
(the pp_ends group, not one of the counted axes) and then over its ZeRO group, since the
pieces of the group's ranks are disjoint. That second all-reduce, of the tp rank's whole
table, V h / t elements in the gradients' dtype, is sent on the first and last stage of
every pipeline whose table is tied, once per step.
"""

from __future__ import annotations

from paratrain.plan import comm
from paratrain.plan.layout import Layout, Workload
from paratrain.plan.model import ModelSpec
from paratrain.plan.rank_groups import Coords, RankTraffic, group_name, shard_rank


def tied_ends_terms(
    model: ModelSpec, workload: Workload, layout: Layout, at: Coords
) -> list[RankTraffic]:
    """The term of a rank on either end of a pipeline with a tied table, under ZeRO."""
    ends = (0, layout.pp - 1)
    k = layout.shard_ranks
    if not (model.tie_embeddings and layout.pp > 1 and layout.zero and k > 1):
        return []
    if at.stage not in ends or not model.has_shape or workload.lora is not None:
        return []
    table = model.parts(layout.tp).last.split  # V h / t
    grad = workload.precision.grad_bytes
    sent = comm.ring_all_reduce_rank_bytes(table, grad, k, shard_rank(layout, at))
    return [RankTraffic(group_name("dp_shard", layout), "all_reduce", TIED, sent)]


TIED = "the tied table's whole gradient, summed over the ZeRO group"
