"""The gradient a rank sums over tp when some of it is partial: the tensors every tp rank
holds whole but whose gradients each rank computes only in part (sequence parallelism's
LayerNorms, row-parallel biases and positions; LoRA's whole adapters, always), as much of
them as this rank's ZeRO shards hold.

Without ZeRO a wrapper sums those tensors whole; a sharded one sums the pieces it holds
(sharded_replica.py `_all_reduce_pieces`, one call per wrapper): its range of each flat
buffer, k ceil(n / k) elements cut into k equal shards. ZeRO-1/2 keep one buffer per
chunk laid out last parameter first (zero.py); ZeRO-3 one per FSDP unit, each in its own
registration order: the tied root (a table on both ends of one chunk), the embeddings,
each block, the final norm and head; LoRA's units are the blocks' adapters. Found by
`paratrain simulate --tp 2 --sequence-parallel --zero 1`: the planner summed every
replicated parameter on every dp rank.
"""

from __future__ import annotations

import math

from paratrain.plan.layout import Layout, Workload
from paratrain.plan.lora import Tensor, adapter_tensors
from paratrain.plan.model import ModelSpec
from paratrain.plan.pipeline import stage_virtual_stages, virtual_stage_layers
from paratrain.plan.rank_memory import tied_root


def trained_units(
    model: ModelSpec, workload: Workload, layout: Layout, stage: int
) -> list[list[list[Tensor]]]:
    """Per chunk on `stage`, its FSDP units' trained tensors in registration order."""
    t, s, c = model.tensors(layout.tp), layout.pp, layout.chunks
    layers = virtual_stage_layers(model.shape.n_layer, s, c)
    root = tied_root(model, layout, stage)
    out = []
    for vs in stage_virtual_stages(stage, s, c):
        if workload.lora is not None:
            out.append([adapter_tensors(model, workload.lora, layout.tp)] * layers[vs])
            continue
        first, last = vs == 0, vs == s * c - 1
        head, tail = list(t.first) if first else [], list(t.last) if last else []
        if first and last and model.tie_embeddings:
            tail = tail[:-1]  # the head is the token table: one parameter
        units = [head[:1], head[1:]] if first and root else [head]  # the root first
        units += [list(t.block)] * layers[vs] + [tail]
        out.append([u for u in units if u])
    return out


def held_unsplit(
    model: ModelSpec, workload: Workload, layout: Layout, stage: int, position: int
) -> int:
    """Elements of the trained tensors held whole on every tp rank that this rank's
    wrappers hold: all without ZeRO, else those in its shard (`position` in its group)."""
    k, position = (layout.shard_ranks, position) if layout.zero else (1, 0)
    buffers: list[list[Tensor]] = []
    for units in trained_units(model, workload, layout, stage):
        if layout.zero >= 3:
            buffers += units
        else:  # one buffer a chunk, last parameter first
            buffers.append([x for unit in units for x in unit][::-1])
    held = 0
    for buffer in buffers:
        shard = math.ceil(sum(n for n, _ in buffer) / k)
        lo, hi, at = position * shard, (position + 1) * shard, 0
        for n, split in buffer:
            held += 0 if split else max(0, min(hi, at + n) - max(lo, at))
            at += n
    return held
