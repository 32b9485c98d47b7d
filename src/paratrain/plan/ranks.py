"""Per-rank predictions for paratrain's own runtime: what each rank of a layout holds and sends.

`estimate` answers for the busiest GPU, with N / (tp pp) parameters per GPU. The runtime's
ranks are not all alike: the first pipeline stage holds the embeddings, the last the final
LayerNorm, the head and the loss; LayerNorms, the position embedding and the row-parallel
biases are replicated across tp. For a model whose N is counted from its shape (our GPT,
`gpt_param_count`) this module counts each rank exactly, so that `plan --validate` and
`paratrain train` can put every rank's prediction beside its measurement.

Traffic per rank per step, by group, is the planner's formulas (comm.py) for that rank's
stage, plus the runtime's bookkeeping scalars, kept apart and labelled because they are a
property of this runtime rather than of the strategy, and too small to matter for a big
model (they are left out of `estimate`, so the seeds' figures reproduce to the byte):
- dp: the (loss, tokens) pair, two float64, all-reduced for token weighting; under ZeRO
  also the gradient norm's two squared sums (split, replicated) of the shards;
- tp: the gradient norm's squared sum of the split parameters, one float64 (train/clip.py);
- pp: the squared norm summed over stages, one float64; the loss broadcast from the last
  stage, one float32, along the chain last -> 0 -> 1 -> ... (comm/traffic.py).

Under ZeRO each chunk (ZeRO-1/2) or FSDP unit (ZeRO-3) is a flat buffer padded to a
multiple of k on its own (parallel/zero_flat.py): `flat_buffers`, `held_model_state` and
`padding_bytes` count it, and `rank_model_state` itemises as the runtime records it.
Gradients are reduced over dp in fp32 whatever the compute dtype (REDUCE_BYTES). ZeRO-2
follows `Workload.zero2_accumulate` as the runtime follows `parallel.zero2_accumulate`:
one reduce-scatter per step ("full", holding the whole gradient meanwhile:
`accumulated_gradient_bytes`) or one per micro-batch ("shard").

Two tensor-parallel terms depend on how this runtime works, so they are counted here:
- full recomputation (PyTorch's non-reentrant checkpoint) stops recomputing a block once
  the last tensor its backward needs is back. With dropout 0 the MLP's closing all-reduce
  feeds nothing that is saved, so only the attention's is repeated: 1 all-reduce per block
  per micro-batch, not Megatron's 2 (comm.py counts those 2 for the plan);
- sequence parallelism leaves the gradients of the replicated parameters (LayerNorms, the
  row-parallel biases, the position embedding) partial: one all-reduce of them per step
  (parallel/tensor_parallel_state.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from paratrain.plan import comm
from paratrain.plan.cluster import ClusterSpec
from paratrain.plan.layout import Layout, Workload
from paratrain.plan.memory import (
    ModelState,
    holds_whole_gradient,
    local_params,
    model_state_bytes,
)
from paratrain.plan.model import ModelSpec
from paratrain.plan.pipeline import stage_virtual_stages, virtual_stage_layers

AXES = ("dp", "tp", "pp")
STATE_KINDS = ("params", "grads", "optimizer", "master")
REDUCE_BYTES = 4  # the runtime reduces gradients over dp in fp32, whatever the compute dtype
# A stand-in cluster: links only label entries; per-rank bytes do not depend on them.
ONE_NODE = ClusterSpec("one node", 1 << 20, 1 << 20, 1e18, 1, 1, 0, 0, 1, 1)


@dataclass(frozen=True)
class Coords:
    """A rank's place in the mesh (mesh.py): pipeline stage, dp replica, tp rank."""

    stage: int = 0
    dp_rank: int = 0
    tp_rank: int = 0


@dataclass(frozen=True)
class RankTraffic:
    axis: str  # dp, tp or pp: the ledger's group name
    op: str
    what: str
    bytes: int  # sent by this rank per optimizer step
    bookkeeping: bool = False  # a runtime scalar that `estimate` leaves out


def exact(model: ModelSpec) -> bool:
    """True when N is counted from the shape, so every rank's share can be counted too."""
    return model.n_params is None and model.has_shape


def chunk_params(model: ModelSpec, layout: Layout, stage: int) -> list[int]:
    """Parameters of each chunk on `stage` (any tp rank), in chunk order.

    Our GPT (models/gpt.py) under GPT_TP_PLAN: per block LayerNorms 4h and row-parallel
    biases 2h replicated, q k v, fc and both projections split, 12 h^2 / t + 7 h / t + 6 h;
    the first virtual stage adds the vocabulary-split token embedding V h / t and the
    replicated positions T_max h; the last adds the final LayerNorm 2h and the head V h / t.
    For a model given by its count alone: N / (tp pp) on one chunk.
    """
    if not exact(model):
        return [local_params(model.params, layout.tp, layout.pp)]
    h, t, v = model.d_model, layout.tp, model.vocab_size
    s, c = layout.pp, layout.chunks
    pieces = virtual_stage_layers(model.n_layer, s, c)  # type: ignore[arg-type]
    block = (12 * h * h + 7 * h) // t + 6 * h  # type: ignore[operator]
    out = []
    for vs in stage_virtual_stages(stage, s, c):
        n = pieces[vs] * block
        if vs == 0:
            n += v * h // t + (model.max_seq_len or model.seq_len) * h  # type: ignore[operator]
        if vs == s * c - 1:
            n += 2 * h + v * h // t  # type: ignore[operator]
        out.append(n)
    return out


def flat_buffers(model: ModelSpec, layout: Layout, stage: int = 0) -> list[list[int]]:
    """Per chunk on `stage` (each chunk is wrapped on its own), the parameter counts of the
    flat buffers that ZeRO shards, each padded to a multiple of k on its own.

    ZeRO-1/2 (parallel/zero.py): one buffer per chunk. ZeRO-3 (parallel/fsdp.py): one per
    FSDP unit of models/plans.py's GPT_FSDP_UNITS: the embeddings V h / t + T_max h, each
    block, the final LayerNorm with the head 2 h + V h / t. A model given by its count
    alone: one buffer per chunk.
    """
    chunks = chunk_params(model, layout, stage)
    if layout.zero < 3 or not exact(model):
        return [[n] for n in chunks]
    h, t, v = model.d_model, layout.tp, model.vocab_size
    s, c = layout.pp, layout.chunks
    pieces = virtual_stage_layers(model.n_layer, s, c)  # type: ignore[arg-type]
    block = (12 * h * h + 7 * h) // t + 6 * h  # type: ignore[operator]
    embeddings = v * h // t + (model.max_seq_len or model.seq_len) * h  # type: ignore[operator]
    head = 2 * h + v * h // t  # type: ignore[operator]
    out = []
    for vs in stage_virtual_stages(stage, s, c):
        units = ([embeddings] if vs == 0 else []) + [block] * pieces[vs]
        out.append(units + ([head] if vs == s * c - 1 else []))
    return out


def held_model_state(
    model: ModelSpec, workload: Workload, layout: Layout, stage: int = 0
) -> ModelState:
    """What the buffers of a rank on `stage` hold, by kind, padding where it lives.

    Per flat buffer of n elements over k = dp ranks, shards of ceil(n / k) (zero_flat.py):
    ZeRO-1/2 keep the whole parameter buffer, k ceil(n / k) elements, and ZeRO-1 the whole
    gradient buffer too; ZeRO-3 keeps one shard of every unit's buffer.
    """
    z, p = layout.zero, workload.precision
    k = layout.dp if z else 1  # unsharded: no padding (DataParallel, ZeRO stage 0)
    buffers = [n for chunk in flat_buffers(model, layout, stage) for n in chunk]
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
        model_state_bytes(n, workload, Layout(dp=layout.dp, zero=layout.zero))
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
    model: ModelSpec, workload: Workload, layout: Layout, stage: int = 0
) -> ModelState:
    """Model-state bytes of a rank on `stage`, itemised as the runtime records them.

    `formula_model_state`, with all the flat buffers' padding (`padding_bytes`) counted
    under params: train/engine.py `Engine.memory_report` adds the wrappers'
    MemoryReport.padding to params. The total is what the buffers hold.
    """
    formula = formula_model_state(model, workload, layout, stage)
    pad = sum(padding_bytes(model, workload, layout, stage).values())
    return replace(formula, params=formula.params + pad)


def accumulated_gradient_bytes(
    model: ModelSpec, workload: Workload, layout: Layout, microbatches: int, stage: int = 0
) -> int:
    """The transient whole gradient of ZeRO-2 with accumulate "full" and K > 1 on `stage`.

    memory.py's `grad_accumulation` for this runtime: the buckets tile each padded flat
    buffer (parallel/zero_flat.py), k ceil(n / k) elements per chunk in the gradient's
    (compute) dtype, alive from the first micro-batch's backward until the reduce-scatter
    after the last. Not in `rank_model_state`, which is the step boundary's record.
    """
    if not holds_whole_gradient(workload, layout, microbatches):
        return 0
    k = layout.dp
    padded = sum(
        k * math.ceil(n / k) for chunk in flat_buffers(model, layout, stage) for n in chunk
    )
    return workload.precision.grad_bytes * padded


def _zero_traffic(
    model: ModelSpec, workload: Workload, layout: Layout, microbatches: int, at: Coords
) -> list[RankTraffic]:
    """comm.dp_traffic's ZeRO formulas per flat buffer (S padded to a multiple of k).

    The runtime reduces gradients in fp32 (MixedPrecision.reduce_dtype) and all-gathers
    parameters in their own dtype. ZeRO-1, and ZeRO-2 with accumulate "full" (the
    default), accumulate the whole gradient over the K micro-batches and reduce-scatter once
    per step: 2 (k - 1) S / k; ZeRO-2 with accumulate "shard" reduce-scatters after every
    micro-batch: (K + 1) (k - 1) S / k. ZeRO-3 gathers each unit for forward and again for
    backward and reduce-scatters it after every backward: 3 (k - 1) S / k per micro-batch.
    """
    runtime = replace(workload, precision=replace(workload.precision, grad_bytes=REDUCE_BYTES))
    layout_k = Layout(dp=layout.dp, zero=layout.zero)
    sent: dict[tuple[str, str], int] = {}
    for chunk in flat_buffers(model, layout, at.stage):
        for n in chunk:
            buffer = ModelSpec("flat buffer", n_params=n)
            for e in comm.dp_traffic(buffer, runtime, layout_k, ONE_NODE, microbatches):
                sent[(e.op, e.what)] = sent.get((e.op, e.what), 0) + e.bytes
    return [RankTraffic("dp", op, what, nbytes) for (op, what), nbytes in sent.items()]


def _dp_gradients(
    model: ModelSpec, workload: Workload, layout: Layout, microbatches: int, at: Coords
) -> list[RankTraffic]:
    k = layout.dp
    if k == 1:
        return []
    if layout.zero:
        return _zero_traffic(model, workload, layout, microbatches, at)
    # One all-reduce per chunk (each chunk is wrapped on its own), exact for one bucket per
    # chunk and for buckets whose element counts k divides.
    sent = sum(
        comm.ring_all_reduce_rank_bytes(n, REDUCE_BYTES, k, at.dp_rank)
        for n in chunk_params(model, layout, at.stage)
    )
    return [RankTraffic("dp", "all_reduce", "gradients", sent)]


def runtime_scalars(layout: Layout, at: Coords) -> list[RankTraffic]:
    """The runtime's per-step bookkeeping traffic (see the module docstring)."""
    out = []
    if layout.dp > 1:
        sent = comm.ring_all_reduce_rank_bytes(2, 8, layout.dp, at.dp_rank)
        out.append(RankTraffic("dp", "all_reduce", "(loss, tokens), float64", sent, True))
        if layout.zero:  # dp ranks hold disjoint gradient shards: their squares add up
            what = "gradient-norm squares of the shards, float64"
            out.append(RankTraffic("dp", "all_reduce", what, sent, True))
    if layout.tp > 1:
        sent = comm.ring_all_reduce_rank_bytes(1, 8, layout.tp, at.tp_rank)
        out.append(RankTraffic("tp", "all_reduce", "gradient-norm squares, float64", sent, True))
    s = layout.pp
    if s > 1:
        sent = comm.ring_all_reduce_rank_bytes(1, 8, s, at.stage)
        out.append(RankTraffic("pp", "all_reduce", "gradient-norm sum, float64", sent, True))
        position = (at.stage - (s - 1)) % s  # chain from the last stage; the end sends nothing
        sent = 4 if position != s - 1 else 0
        out.append(RankTraffic("pp", "broadcast", "loss from the last stage, float32", sent, True))
    return out


def replicated_params(model: ModelSpec, layout: Layout, stage: int) -> int:
    """Parameters replicated across tp on `stage`: per block 2 LayerNorms and 2 row-parallel
    biases (6h), the positions on the first virtual stage, the final LayerNorm on the last."""
    h, s, c = model.d_model, layout.pp, layout.chunks
    pieces = virtual_stage_layers(model.n_layer, s, c)  # type: ignore[arg-type]
    n = 0
    for vs in stage_virtual_stages(stage, s, c):
        n += pieces[vs] * 6 * h  # type: ignore[operator]
        n += (model.max_seq_len or model.seq_len) * h if vs == 0 else 0  # type: ignore[operator]
        n += 2 * h if vs == s * c - 1 else 0  # type: ignore[operator]
    return n


def _tp_terms(
    model: ModelSpec,
    workload: Workload,
    layout: Layout,
    microbatches: int,
    at: Coords,
    sequence_parallel: bool,
    dropout: float,
) -> list[RankTraffic]:
    plain = replace(workload, recompute="none") if workload.recompute == "full" else workload
    out = [
        RankTraffic("tp", e.op, e.what, e.bytes)
        for e in comm.tp_traffic(model, plain, layout, ONE_NODE, microbatches, at.stage)
    ]
    if layout.tp == 1:
        return out
    t, size = layout.tp, comm.activation_message_bytes(model, workload)
    if workload.recompute == "full":
        layers = sum(
            virtual_stage_layers(model.n_layer, layout.pp, layout.chunks)[vs]  # type: ignore[arg-type]
            for vs in stage_virtual_stages(at.stage, layout.pp, layout.chunks)
        )
        repeated = 1 if dropout == 0 else 2  # see the module docstring
        sent = microbatches * layers * repeated * comm.all_reduce_bytes(size, t)
        out.append(RankTraffic("tp", "all_reduce", "recomputed forward", sent))
    if sequence_parallel:
        n = replicated_params(model, layout, at.stage)
        sent = comm.ring_all_reduce_rank_bytes(n, workload.precision.grad_bytes, t, at.tp_rank)
        what = "sequence-parallel gradient sum of replicated parameters"
        out.append(RankTraffic("tp", "all_reduce", what, sent))
    return out


def rank_traffic(
    model: ModelSpec,
    workload: Workload,
    layout: Layout,
    microbatches: int,
    at: Coords,
    sequence_parallel: bool = False,
    dropout: float = 0.0,
) -> list[RankTraffic]:
    """Everything a rank sends per optimizer step: the planner's terms, then bookkeeping."""
    out = _dp_gradients(model, workload, layout, microbatches, at)
    if layout.tp > 1 or layout.pp > 1:
        out += _tp_terms(model, workload, layout, microbatches, at, sequence_parallel, dropout)
        for e in comm.pp_traffic(model, workload, layout, ONE_NODE, microbatches, at.stage):
            out.append(RankTraffic("pp", e.op, e.what, e.bytes))
    return out + runtime_scalars(layout, at)


def bytes_by_axis(terms: list[RankTraffic], bookkeeping: bool = True) -> dict[str, int]:
    """{dp, tp, pp: bytes per step}; without bookkeeping, the planner's terms only."""
    return {
        axis: sum(t.bytes for t in terms if t.axis == axis and (bookkeeping or not t.bookkeeping))
        for axis in AXES
    }
