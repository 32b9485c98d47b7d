"""The runtime's bookkeeping traffic per step: scalars that are a property of this runtime
rather than of the strategy, and too small to matter for a big model (they are left out
of `estimate`, so the seeds' figures reproduce to the byte); rank_traffic.py adds them to
each rank's terms, labelled as bookkeeping:
- dp_cp (the gradient group; "dp" with cp 1: rank_groups.py): the (loss, tokens) pair,
  two float64, all-reduced for token weighting; under ZeRO also the gradient norm's two
  squared sums (split, replicated) of the shards;
- tp: the gradient norm's squared sum of the split parameters, one float64 (train/clip.py);
- pp: the squared norm summed over stages, one float64; the loss broadcast from the last
  stage, one float32, along the chain last -> 0 -> 1 -> ... (comm/traffic.py); with a
  mixture of experts instead the loss summed over the stages (each holds its blocks'
  balancing terms) and the routing log's two all-reduces (train/experts.py).
"""

from __future__ import annotations

from paratrain.plan import comm
from paratrain.plan.layout import Layout
from paratrain.plan.rank_groups import Coords, RankTraffic, data_rank, group_name, shard_rank


def runtime_scalars(layout: Layout, at: Coords, experts: bool = False) -> list[RankTraffic]:
    """The runtime's per-step bookkeeping traffic (see the module docstring)."""
    out, k, dp = [], layout.data_ranks, group_name("dp_cp", layout)
    if k > 1:
        sent = comm.ring_all_reduce_rank_bytes(2, 8, k, data_rank(layout, at))
        out.append(RankTraffic(dp, "all_reduce", "(loss, tokens), float64", sent, True))
    k = layout.shard_ranks
    if layout.zero and k > 1:  # the ranks of a replica group (dp_cp without HSDP) hold
        # disjoint gradient shards: their squares add up (train/clip.py)
        sent = comm.ring_all_reduce_rank_bytes(2, 8, k, shard_rank(layout, at))
        what = "gradient-norm squares of the shards, float64"
        out.append(RankTraffic(group_name("dp_shard", layout), "all_reduce", what, sent, True))
    if layout.tp > 1:
        sent = comm.ring_all_reduce_rank_bytes(1, 8, layout.tp, at.tp_rank)
        out.append(RankTraffic("tp", "all_reduce", "gradient-norm squares, float64", sent, True))
    s = layout.pp
    if s > 1:
        sent = comm.ring_all_reduce_rank_bytes(1, 8, s, at.stage)
        out.append(RankTraffic("pp", "all_reduce", "gradient-norm sum, float64", sent, True))
        if experts:  # every stage holds terms of the loss; the routing log spans stages
            for n, elem, what in [(1, 4, "loss summed over stages, float32"),
                                  (3, 8, "routing log sums, float64"),
                                  (2, 8, "routing log extremes, float64")]:  # fmt: skip
                sent = comm.ring_all_reduce_rank_bytes(n, elem, s, at.stage)
                out.append(RankTraffic("pp", "all_reduce", what, sent, True))
            return out
        position = (at.stage - (s - 1)) % s  # chain from the last stage; the end sends nothing
        sent = 4 if position != s - 1 else 0
        out.append(RankTraffic("pp", "broadcast", "loss from the last stage, float32", sent, True))
    return out
