"""The all-to-alls of expert parallelism as planner entries: per MoE layer on the first
stage, per micro-batch, the counts (forward) and the tokens (dispatch and combine, every
pass), for the busiest ep rank under the router's imbalance (plan/moe.py derives them).
"""

from __future__ import annotations

from paratrain.plan import moe
from paratrain.plan.cluster import ClusterSpec
from paratrain.plan.comm import CommEntry, axis_link
from paratrain.plan.expert_cost import counts_bytes
from paratrain.plan.layout import Layout, Workload
from paratrain.plan.model import ModelSpec
from paratrain.plan.pipeline import stage_layers


def ep_traffic(
    model: ModelSpec, workload: Workload, layout: Layout, cluster: ClusterSpec, microbatches: int
) -> list[CommEntry]:
    ep = layout.ep
    if ep == 1 or not model.num_experts:
        return []
    calls = microbatches * stage_layers(model.shape.n_layer, 0, layout.pp, layout.chunks)
    passes = 3 if workload.recompute == "full" else 2  # forward, backward, forward again
    tokens = workload.micro_batch * model.shape.seq_len / layout.cp
    elem = workload.precision.activation_bytes
    per_pass = moe.all_to_all_bytes(model, tokens, ep, layout.tp, elem, workload.moe_imbalance)
    link = axis_link("ep", layout, cluster)
    fwd_passes = passes - 1
    counts = calls * fwd_passes * counts_bytes(model.num_experts, ep)
    tokens_sent = round(calls * passes * per_pass)
    return [
        CommEntry("all_to_all", "ep", link, "expert counts", counts, calls * fwd_passes * (ep - 1)),
        CommEntry(
            "all_to_all", "ep", link, "tokens to experts and back", tokens_sent,
            calls * passes * 2 * (ep - 1),
        ),
    ]  # fmt: skip
