"""Muon on each rank of paratrain's own runtime: what it sends per step, and the FLOPs
of the matrices it orthogonalizes (plan/muon.py for whole or tp-split matrices,
plan/muon_shards.py over ZeRO's shards)."""

from __future__ import annotations

from paratrain.plan import muon
from paratrain.plan.layout import Layout, Workload, flat_buffered
from paratrain.plan.model import ModelSpec
from paratrain.plan.muon_shards import stage_muons
from paratrain.plan.rank_groups import Coords, RankTraffic, data_rank, group_name, shard_rank


def muon_terms(
    model: ModelSpec, workload: Workload, layout: Layout, at: Coords, moe: int = 0
) -> list[RankTraffic]:
    """Muon over whole (or tp-split) matrices: the owners' results all-gathered over the
    gradient group, and over tp the shards to their owners and back (plan/muon.py); over
    ZeRO's shards (or a mixed-precision stage 0's one buffer), muon_shards.py's terms.
    With a mixture of experts (`moe`: plan/muon.py) the dense share's; the experts' own
    share has no matrix and sends nothing."""
    ns, rank, tp = workload.muon_ns_bytes, data_rank(layout, at), layout.tp
    if flat_buffered(workload, layout):
        me = shard_rank(layout, at) if layout.zero else 0  # stage 0: one unsharded buffer
        chunks = stage_muons(model, layout, at.stage, moe)
        dp = sum(c.dp_bytes(me, ns) for c in chunks) if layout.zero else 0
        tp_sent = sum(c.tp_bytes(me, at.tp_rank, tp, ns) for c in chunks) if tp > 1 else 0
        what = "Muon's pieces to owners and back"
        out = [RankTraffic(group_name("dp_shard", layout), "all_to_all", what, dp)]
    else:
        gathered = muon.gather_bytes(model, layout, at.stage, rank, ns, moe)
        tp_sent = muon.tp_bytes(model, layout, at.stage, rank, at.tp_rank, ns, moe) if tp > 1 else 0
        out = [RankTraffic(group_name("dp_cp", layout), "all_gather", "Muon's results", gathered)]
    if tp > 1:
        out.append(RankTraffic("tp", "all_to_all", "Muon's matrices to owners and back", tp_sent))
    return out


def muon_flops(
    model: ModelSpec, workload: Workload, layout: Layout, at: Coords, moe: int = 0
) -> int:
    """The Newton-Schulz FLOPs of the matrices this rank orthogonalizes per step, as
    FlopCounterMode counts them: per iteration two products of (m, n) by (n, m) sizes
    and one (m, m) by (m, m), 2 (2 m^2 n + m^3) (plan/muon.py `iteration_flops`)."""
    if not workload.muon_ns_bytes:
        return 0
    t, per = layout.tp, 2 * workload.muon_ns_steps
    if flat_buffered(workload, layout):
        me = shard_rank(layout, at) if layout.zero else 0
        return sum(
            per * muon.iteration_flops(m)
            for c in stage_muons(model, layout, at.stage, moe)
            for m, owner, numbered in zip(c.shapes, c.owners, c.tp_owners, strict=True)
            if owner == me and numbered % t == at.tp_rank
        )
    mine = data_rank(layout, at) * t + at.tp_rank  # owners numbered d tp + t
    return sum(
        per * muon.iteration_flops(m)
        for matrices in muon.chunk_matrices(model, layout, at.stage, moe)
        for m, owner in zip(matrices, muon.owners_of(matrices, layout.data_ranks * t), strict=True)
        if owner == mine
    )
