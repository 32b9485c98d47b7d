"""What a rank sends over its cp group per step: context.py's formulas for the layers of
the rank's own pipeline stage, exact for the runtime (parallel/context_parallel/).

Per layer and micro-batch, with c = cp, t = tp, b s tokens of which a rank holds s / c:
- ring: every pass sends this rank's keys and values c - 1 times, 2 b (s/c) (h_kv/t) d e
  bytes a message; backward sends them again and their gradients as well, so a layer
  costs (c - 1) (fwd + 2) messages (`context.ring_passes`: fwd is 2 when full
  recomputation runs the forward again);
- all-to-all (Ulysses): per pass one fused all-to-all of q, k, v and one of the output,
  b (s/c) (2h + 2h_kv)/t d e (c - 1)/c bytes (`context.ulysses_pass_bytes`).

e is the compute dtype's element size (the activations'). The gradient reduction over
dp_cp and the runtime's scalars there are rank_traffic.py's; this module only adds cp.
"""

from __future__ import annotations

from paratrain.plan import context
from paratrain.plan.layout import Layout, Workload
from paratrain.plan.model import ModelSpec
from paratrain.plan.pipeline import recomputed_layers, stage_layers
from paratrain.plan.rank_groups import RankTraffic


def cp_exchanges(
    model: ModelSpec, workload: Workload, layout: Layout, microbatches: int, stage: int
) -> int:
    """What a rank on `stage` exchanges over cp per step: the ring's hops (each a send
    and a receive) or all-to-all's passes (each two all-to-alls, q k v and the output);
    recomputed forwards counted as often as they run (pipeline.recomputed_layers)."""
    n, s, v = model.shape.n_layer, layout.pp, layout.chunks
    blocks = microbatches * stage_layers(n, stage, s, v)
    fwd, bwd = context.ring_passes(workload.recompute)
    again = microbatches * recomputed_layers(n, stage, s, v, layout.schedule) * (fwd - 1)
    if layout.cp_method == "ring":
        return (layout.cp - 1) * (blocks * (1 + 2 * bwd) + again)
    return blocks * (1 + bwd) + again


def cp_terms(
    model: ModelSpec, workload: Workload, layout: Layout, microbatches: int, stage: int
) -> list[RankTraffic]:
    """The cp group's traffic of a rank on pipeline `stage` (none with cp 1)."""
    if layout.cp == 1:
        return []
    exchanges = cp_exchanges(model, workload, layout, microbatches, stage)
    if layout.cp_method == "ring":
        sent = exchanges * context.ring_hop_bytes(model, workload, layout)
        return [
            RankTraffic("cp", "send", "keys and values, and their gradients (ring)", round(sent))
        ]
    sent = exchanges * context.ulysses_pass_bytes(model, workload, layout)
    return [RankTraffic("cp", "all_to_all", "q, k, v and outputs (all-to-all)", round(sent))]
