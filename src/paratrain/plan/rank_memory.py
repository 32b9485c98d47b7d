"""Per-rank model state for paratrain's own runtime: what each rank of a layout holds.

`estimate` answers for the busiest GPU, with N / (tp pp) parameters per GPU. The runtime's
ranks are not all alike: the first pipeline stage holds the embeddings, the last the final
LayerNorm, the head and the loss; LayerNorms, the position embedding and the row-parallel
biases are replicated across tp. For a model whose N is counted from its shape (our GPT,
`gpt_param_count`) this module counts each rank exactly, so that `plan --validate` and
`paratrain train` can put every rank's prediction beside its measurement (rank_traffic.py
does the same for the bytes each rank sends).

Under ZeRO each chunk (ZeRO-1/2) or FSDP unit (ZeRO-3) is a flat buffer padded to a
multiple of k on its own, k = dp x cp since the cp ranks hold the same parameters
(parallel/data_parallel/flat_buffer.py): `flat_buffers`, `held_model_state` and
`padding_bytes` count it, and `rank_model_state` itemises as the runtime records it.
ZeRO-2 follows `Workload.zero2_accumulate` as the runtime follows
`parallel.zero2_accumulate`: with "full" it holds the whole gradient between the
micro-batches of a step (`accumulated_gradient_bytes`).
"""

from __future__ import annotations

import math
from dataclasses import replace

from paratrain.plan.layout import Layout, Workload, flat_buffered
from paratrain.plan.lora import adapter_buffers, held_frozen_bytes
from paratrain.plan.memory import (
    ModelState,
    holds_whole_gradient,
    local_params,
    model_state_bytes,
)
from paratrain.plan.model import ModelSpec
from paratrain.plan.muon import momentum_elements
from paratrain.plan.muon_shards import optimizer_elements
from paratrain.plan.pipeline import stage_virtual_stages, virtual_stage_layers

STATE_KINDS = ("params", "grads", "optimizer", "master")


def exact(model: ModelSpec) -> bool:
    """True when N is counted from the shape, so every rank's share can be counted too."""
    return model.n_params is None and model.has_shape


def plain_training(model: ModelSpec, workload: Workload) -> bool:
    """A dense model counted from its shape, every parameter trained by AdamW or SGD, its
    gradients reduced exactly and synchronously: no LoRA, Muon, --compress or DiLoCo
    (the runs whose calls and checkpoint part rank_calls.py and rank_checkpoint.py count)."""
    other = workload.lora or workload.muon_ns_bytes or workload.sync_every
    return not other and workload.compress == "none" and exact(model) and not model.num_experts


def chunk_params(model: ModelSpec, layout: Layout, stage: int) -> list[int]:
    """Parameters of each chunk on `stage` (any tp rank), in chunk order.

    Per block and at each end, this rank's slice of what tensor parallelism splits plus
    whatever it replicates (`ModelSpec.parts`): for our GPT per block 12 h^2 / t + 7 h / t
    split and 6 h replicated (LayerNorms, row-parallel biases); the first virtual stage
    adds the vocabulary-split token table V h / t and the positions T_max h, the last the
    final LayerNorm 2h and the head V h / t. For a model given by its count alone:
    N / (tp pp) on one chunk.
    """
    if not exact(model):
        return [local_params(model.params, layout.tp, layout.pp)]
    parts, s, c = model.parts(layout.tp), layout.pp, layout.chunks
    pieces = virtual_stage_layers(model.shape.n_layer, s, c)
    return [
        pieces[vs] * parts.block.total + parts.ends(vs == 0, vs == s * c - 1)
        for vs in stage_virtual_stages(stage, s, c)
    ]


def flat_buffers(
    model: ModelSpec, layout: Layout, stage: int = 0, block_delta: int = 0
) -> list[list[int]]:
    """Per chunk on `stage` (each chunk is wrapped on its own), the parameter counts of the
    flat buffers that ZeRO shards, each padded to a multiple of k on its own.

    ZeRO-1/2 (parallel/data_parallel/zero.py): one buffer per chunk. ZeRO-3
    (parallel/data_parallel/fsdp.py): one per FSDP unit of the model's plan
    (models/plans.py): the embeddings, each block, the final norm with the head; a
    weight tied between the two ends forms a root unit of its own (and a unit left with
    no parameter is none). A model given by its count alone: one
    buffer per chunk. `block_delta`: parameters each block holds beyond the model's (a
    mixture of experts' dense share: its MoE less the dense MLP and the split experts).
    """
    chunks = chunk_params(model, layout, stage)
    s, c = layout.pp, layout.chunks
    pieces = virtual_stage_layers(model.n_layer or 0, s, c) if block_delta else []
    if layout.zero < 3 or not exact(model):
        if not block_delta:
            return [[n] for n in chunks]
        vss = stage_virtual_stages(stage, s, c)
        return [[n + block_delta * pieces[vs]] for n, vs in zip(chunks, vss, strict=True)]
    parts = model.parts(layout.tp)
    pieces = virtual_stage_layers(model.shape.n_layer, s, c)
    root = tied_root(model, layout, stage)
    out = []
    for vs in stage_virtual_stages(stage, s, c):
        first, last = vs == 0, vs == s * c - 1
        ends = [parts.first.total - root if first else 0, parts.last.total - root if last else 0]
        units = [root, ends[0], *[parts.block.total + block_delta] * pieces[vs], ends[1]]
        out.append([n for n in units if n])
    return out


def tied_root(model: ModelSpec, layout: Layout, stage: int = 0) -> int:
    """ZeRO-3's root unit on `stage`: the token table tied to the head when one chunk holds
    both ends (parallel/data_parallel/fsdp.py gathers it once per forward and keeps it until its
    gradient arrives, instead of gathering it again for backward); 0 when there is none."""
    if layout.zero < 3 or not exact(model) or not model.tie_embeddings:
        return 0
    s, c = layout.pp, layout.chunks
    if not any(vs == 0 and vs == s * c - 1 for vs in stage_virtual_stages(stage, s, c)):
        return 0
    return model.parts(layout.tp).last.split


def held_model_state(
    model: ModelSpec, workload: Workload, layout: Layout, stage: int = 0
) -> ModelState:
    """What the buffers of a rank on `stage` hold, by kind, padding where it lives.

    Per flat buffer of n elements over the k = dp x cp ranks of dp_cp (under HSDP the
    k / R of a replica group), shards of ceil(n / k)
    (flat_buffer.py):
    ZeRO-1/2 keep the whole parameter buffer, k ceil(n / k) elements, and ZeRO-1 the whole
    gradient buffer too; ZeRO-3 keeps one shard of every unit's buffer.
    """
    buffers = [n for chunk in flat_buffers(model, layout, stage) for n in chunk]
    return buffers_held_state(buffers, workload, layout)


def buffers_held_state(buffers: list[int], workload: Workload, layout: Layout) -> ModelState:
    """`held_model_state` of flat buffers of these parameter counts (`flat_buffers`)."""
    z, p = layout.zero, workload.precision
    k = layout.shard_ranks if z else 1  # unsharded: no padding (DataParallel, ZeRO stage 0)
    shard = sum(math.ceil(n / k) for n in buffers)
    full = sum(k * math.ceil(n / k) for n in buffers)
    return ModelState(
        params=p.param_bytes * (shard if z >= 3 else full),
        grads=p.grad_bytes * (shard if z >= 2 else full),
        optimizer=workload.moments * p.moment_bytes * (shard if z >= 1 else full),
        master=p.master_bytes * (shard if z >= 1 else full),
    )


def formula_model_state(
    model: ModelSpec, workload: Workload, layout: Layout, stage: int = 0
) -> ModelState:
    """memory.py's items per chunk (n whole, ceil(n / k) a shard; each chunk is wrapped on
    its own), summed over the chunks of `stage`."""
    states = [
        model_state_bytes(n, workload, Layout(dp=layout.shard_ranks, zero=layout.zero))
        for n in chunk_params(model, layout, stage)
    ]
    return ModelState(*(sum(getattr(st, kind) for st in states) for kind in STATE_KINDS))


def padding_bytes(
    model: ModelSpec, workload: Workload, layout: Layout, stage: int = 0
) -> dict[str, int]:
    """Bytes the flat buffers hold beyond `formula_model_state`, by kind: for ZeRO-1/2 the
    k ceil(n / k) - n padding elements of the whole buffers; for ZeRO-3 the units' shards
    beyond one ceil(N / k) shard of the chunk's N parameters."""
    held = held_model_state(model, workload, layout, stage).as_dict()
    formula = formula_model_state(model, workload, layout, stage).as_dict()
    return {kind: held[kind] - formula[kind] for kind in STATE_KINDS}


def rank_model_state(
    model: ModelSpec, workload: Workload, layout: Layout, stage: int = 0, shard: int = 0
) -> ModelState:
    """Model-state bytes of a rank on `stage`, itemised as the runtime records them.

    `formula_model_state`, with all the flat buffers' padding (`padding_bytes`) counted
    under params: train/engine.py `Engine.memory_report` adds the wrappers'
    MemoryReport.padding to params. The total is what the buffers hold. Under Muon its
    matrices hold one momentum instead of AdamW's two: over ZeRO's shards, the pieces the
    rank at `shard` in its shard group holds (muon_shards.py), the padding neither.
    """
    if workload.lora is not None:
        return lora_rank_model_state(model, workload, layout, stage)
    formula = formula_model_state(model, workload, layout, stage)
    pads = padding_bytes(model, workload, layout, stage)
    sharded = bool(workload.muon_ns_bytes) and flat_buffered(workload, layout)
    if sharded:  # Muon's AdamW keeps no moments for the padding (fsdp.py memory_report)
        pads["optimizer"] = 0
    state = replace(formula, params=formula.params + sum(pads.values()))
    moment = workload.precision.moment_bytes
    if sharded:
        mine = optimizer_elements(model, layout, stage, shard if layout.zero else 0)
        state = replace(state, optimizer=moment * mine)
    elif workload.muon_ns_bytes:  # whole matrices: one momentum each instead of two moments
        muon = moment * momentum_elements(model, layout, stage)
        state = replace(state, optimizer=state.optimizer - muon)
    return state


def lora_rank_model_state(
    model: ModelSpec, workload: Workload, layout: Layout, stage: int = 0
) -> ModelState:
    """`rank_model_state` of a LoRA run (plan/lora.py): the adapters' flat buffers as any
    trained parameters' (padding under params), and the frozen base under params."""
    lora = workload.lora
    assert lora is not None
    s, c = layout.pp, layout.chunks
    layers = virtual_stage_layers(model.shape.n_layer, s, c)
    blocks = [layers[vs] for vs in stage_virtual_stages(stage, s, c)]
    state = buffers_model_state(adapter_buffers(model, lora, layout, blocks), workload, layout)
    base = [n for chunk in flat_buffers(model, layout, stage) for n in chunk]
    return replace(state, params=state.params + held_frozen_bytes(base, workload, layout))


def buffers_model_state(buffers: list[int], workload: Workload, layout: Layout) -> ModelState:
    """`rank_model_state` of one wrapper's flat buffers (parameter counts) over
    `layout.data_ranks`: memory.py's formula for their total, their padding under params
    (a mixture of experts' parameter shares, rank_experts.py)."""
    lay = Layout(dp=layout.shard_ranks, zero=layout.zero)
    formula = model_state_bytes(sum(buffers), workload, lay)
    held = buffers_held_state(buffers, workload, layout).as_dict()
    pads = {kind: held[kind] - getattr(formula, kind) for kind in STATE_KINDS}
    if workload.muon_ns_bytes and flat_buffered(workload, layout):
        pads["optimizer"] = 0  # Muon's AdamW keeps no moments for the padding
    return replace(formula, params=formula.params + sum(pads.values()))


def accumulated_gradient_bytes(
    model: ModelSpec, workload: Workload, layout: Layout, microbatches: int, stage: int = 0
) -> int:
    """The transient whole gradient of ZeRO-2 with accumulate "full" and K > 1 on `stage`.

    memory.py's `grad_accumulation` for this runtime: the buckets tile each padded flat
    buffer (parallel/data_parallel/flat_buffer.py), k ceil(n / k) elements per chunk in the
    gradient's (compute) dtype, alive from the first micro-batch's backward until the reduce-scatter
    after the last. Not in `rank_model_state`, which is the step boundary's record.
    """
    if not holds_whole_gradient(workload, layout, microbatches):
        return 0
    k = layout.shard_ranks
    padded = sum(
        k * math.ceil(n / k) for chunk in flat_buffers(model, layout, stage) for n in chunk
    )
    return workload.precision.grad_bytes * padded


def replicated_params(model: ModelSpec, layout: Layout, stage: int) -> int:
    """Parameters replicated across tp on `stage` (`ModelSpec.parts`): for our GPT per block
    2 LayerNorms and 2 row-parallel biases (6h), the positions on the first virtual stage,
    the final LayerNorm on the last; for Llama the RMSNorms."""
    parts, s, c = model.parts(layout.tp), layout.pp, layout.chunks
    pieces = virtual_stage_layers(model.shape.n_layer, s, c)
    return sum(
        pieces[vs] * parts.block.replicated + parts.ends_replicated(vs == 0, vs == s * c - 1)
        for vs in stage_virtual_stages(stage, s, c)
    )
