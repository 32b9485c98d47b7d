"""Context parallelism in the planner: key/value traffic, its overlap with attention, and
the all-to-all (Ulysses) alternative (docs/context-parallel.md derives the bytes; they are
plan/context_cost.py's formulas, the runtime's, for one tp rank's 1/t of the heads).

Per layer, per micro-batch, on one GPU of a cp group of c ranks and a tp group of t (tensor
parallelism splits the heads, so each tp rank moves 1/t of them); b s tokens, h_kv
key/value heads of dimension d, e bytes per element:

- ring: forward c - 1 messages of 2 b (s/c) (h_kv/t) d e, so 2 b s h_kv d e (c-1)/(c t)
  bytes; backward twice that (keys and values again, and their gradients); full and
  selective recomputation run the forward ring once more.
- all-to-all: per pass 2 (c - 1) messages, b (s/c) (2h + 2h_kv)/t d e (c - 1)/c bytes.

Time. A ring step's transfer runs while the rank attends to the block it already has, so
per step only max(0, transfer - block) is exposed, c - 1 times per pass. The block is
what our load-balanced causal ring computes per step: two (s/2c)-long chunk pairs, 2 b s^2
(h/t) d / c^2 FLOPs forward, 5/2 of that backward (it recomputes q k^T: context_cost.ring_flops).
The all-to-all waits for its data: all of it is exposed.
"""

from __future__ import annotations

from paratrain.plan import context_cost
from paratrain.plan.cluster import ClusterSpec
from paratrain.plan.comm import CommEntry, axis_link
from paratrain.plan.layout import Layout, Workload
from paratrain.plan.model import ModelSpec
from paratrain.plan.pipeline import stage_layers
from paratrain.plan.time import entry_time

BACKWARD_BLOCK = 2.5  # backward matmuls over forward's in a ring block (context_cost.ring_flops)


def head_dim(model: ModelSpec) -> int:
    return model.shape.d_model // model.shape.n_head


def kv_heads_of(model: ModelSpec) -> int:
    return model.n_kv_head or model.shape.n_head


def ring_hop_bytes(model: ModelSpec, workload: Workload, layout: Layout) -> float:
    """One hop: this rank's keys and values, 2 b (s/c) (h_kv/t) d e."""
    b, s, e = workload.micro_batch, model.shape.seq_len, workload.precision.activation_bytes
    kv = kv_heads_of(model) / layout.tp
    return context_cost.ring_message_bytes(b, s, kv, head_dim(model), e, layout.cp)


def ulysses_pass_bytes(model: ModelSpec, workload: Workload, layout: Layout) -> float:
    """Both all-to-alls of one pass: b (s/c) (2h + 2h_kv)/t d e (c - 1)/c."""
    b, s, e = workload.micro_batch, model.shape.seq_len, workload.precision.activation_bytes
    heads, kv = model.shape.n_head / layout.tp, kv_heads_of(model) / layout.tp
    return context_cost.ulysses_bytes(b, s, heads, kv, head_dim(model), e, layout.cp)


def ring_passes(recompute: str) -> tuple[int, int]:
    """(forward rings, backward rings) per layer and micro-batch; recomputation: 2 forward.
    Selective too: the runtime's policy recomputes collectives (parallel/recompute.py),
    and the cp exchange is not among the outputs it keeps."""
    return (1 if recompute == "none" else 2), 1


def _first_stage_layers(model: ModelSpec, layout: Layout) -> int:
    return stage_layers(model.shape.n_layer, 0, layout.pp, layout.chunks)


def cp_traffic(
    model: ModelSpec, workload: Workload, layout: Layout, cluster: ClusterSpec, microbatches: int
) -> list[CommEntry]:
    """Keys and values (ring) or heads (all-to-all) over the cp group, on the first stage."""
    c = layout.cp
    if c == 1:
        return []
    link = axis_link("cp", layout, cluster)
    calls = microbatches * _first_stage_layers(model, layout)
    fwd, bwd = ring_passes(workload.recompute)
    if layout.cp_method == "ring":
        messages = calls * (c - 1) * (fwd + 2 * bwd)
        nbytes = messages * ring_hop_bytes(model, workload, layout)
        return [CommEntry("send", "cp", link, "keys and values (ring)", round(nbytes), messages)]
    passes = calls * (fwd + bwd)
    nbytes = passes * ulysses_pass_bytes(model, workload, layout)
    what = "q, k, v and outputs (all-to-all)"
    return [CommEntry("all_to_all", "cp", link, what, round(nbytes), passes * 2 * (c - 1))]


def ring_block_s(
    model: ModelSpec, workload: Workload, layout: Layout, cluster: ClusterSpec
) -> float:
    """Forward seconds of one ring step's attention block (module docstring)."""
    b, s, c = workload.micro_batch, model.shape.seq_len, layout.cp
    flops = 2 * b * s * s * model.shape.d_model / layout.tp / (c * c)
    return flops / cluster.effective_flops


def ring_hidden_s(
    model: ModelSpec, workload: Workload, layout: Layout, cluster: ClusterSpec, microbatches: int
) -> float:
    """Seconds of ring traffic hidden behind attention blocks in one step.

    Per step forward: min(transfer, block); backward: min(2 transfers, 5/2 block)."""
    if layout.cp == 1 or layout.cp_method != "ring":
        return 0.0
    (entry,) = cp_traffic(model, workload, layout, cluster, 1)
    hop = entry_time(entry, cluster) / entry.messages  # one message, alpha included
    block = ring_block_s(model, workload, layout, cluster)
    fwd, bwd = ring_passes(workload.recompute)
    per_layer = (layout.cp - 1) * (
        fwd * min(hop, block) + bwd * min(2 * hop, BACKWARD_BLOCK * block)
    )
    return microbatches * _first_stage_layers(model, layout) * per_layer


def ring_buffer_bytes(model: ModelSpec, workload: Workload, layout: Layout) -> float:
    """What cp adds to activations: the ring's chunk in flight, received and sent, for the
    one layer running (2 messages); the all-to-all's buffers are the size of the rank's
    own q, k, v and output, already counted."""
    if layout.cp == 1 or layout.cp_method != "ring":
        return 0.0
    return 2 * ring_hop_bytes(model, workload, layout)


def cp_problems(model: ModelSpec, layout: Layout) -> list[str]:
    """Why a cp degree cannot run this model, as the runtime refuses it."""
    c = layout.cp
    if c == 1:
        return []
    if not model.has_shape:
        return [
            f"cp {c}: context-parallel traffic needs the model's shape "
            "(--layers --hidden --heads --vocab --seq-len)"
        ]
    if layout.cp_method == "alltoall":
        heads, kv = model.shape.n_head, kv_heads_of(model)
        if heads % (c * layout.tp) or kv % (c * layout.tp):
            return [
                f"all-to-all cp {c} x tp {layout.tp} does not divide {heads} heads and {kv} "
                "key/value heads"
            ]
    elif model.shape.seq_len % (2 * c):
        return [f"sequence {model.shape.seq_len} does not split into 2 x cp {c} balanced chunks"]
    return []
