"""Per-rank traffic for paratrain's own runtime: what each rank of a layout sends per step.

Traffic per rank per step, by group, is the planner's formulas (comm.py) for that rank's
stage (its parameters counted exactly by rank_memory.py), plus the runtime's bookkeeping
scalars (runtime_scalars.py), kept apart and labelled.

Gradients are reduced over dp_cp (dp x cp ranks: the cp ranks hold the same parameters)
in fp32 whatever the compute dtype (REDUCE_BYTES), one flat buffer at a time under ZeRO
(rank_memory.flat_buffers), without ZeRO a bucket at a time (grad_buckets.py). ZeRO-2
follows `Workload.zero2_accumulate`. cp's own traffic: rank_context.py; experts' rank_experts.py.

Two tensor-parallel terms depend on how this runtime works, so they are counted here:
- full recomputation (PyTorch's non-reentrant checkpoint) stops recomputing a block once
  the last tensor its backward needs is back. With dropout 0 the MLP's closing all-reduce
  feeds nothing that is saved, so only the attention's is repeated: 1 all-reduce per block
  per micro-batch, not Megatron's 2 (comm.py counts those 2 for the plan). Selective
  recomputation (parallel/recompute.py) recomputes the collectives between the kept
  matmuls and stops at the same tensor, so it repeats the same all-reduces. With sequence
  parallelism the attention's all-reduce is a reduce-scatter and both all-gathers before
  it and the MLP are repeated too: 1.5 all-reduces' bytes per block (2 with dropout);
- sequence parallelism leaves the gradients of the replicated parameters (LayerNorms, the
  row-parallel biases, the position embedding) partial: one all-reduce of them per step
  (parallel/tensor_parallel/state.py).
"""

from __future__ import annotations

from dataclasses import replace

from paratrain.plan import comm
from paratrain.plan import rank_compress as compressed
from paratrain.plan.cluster import ClusterSpec
from paratrain.plan.grad_buckets import chunk_tensors, gradient_buckets
from paratrain.plan.held_pieces import held_unsplit
from paratrain.plan.layout import Layout, Workload
from paratrain.plan.lora_traffic import frozen_gathers, lora_chunks, lora_tp_terms
from paratrain.plan.model import ModelSpec
from paratrain.plan.pipeline import recomputed_layers
from paratrain.plan.rank_context import cp_terms
from paratrain.plan.rank_experts import (
    ExpertCounts,
    dense_moe,
    moe_terms,
    share_layout,
    shares,
    tp_activation_bytes,
)
from paratrain.plan.rank_groups import (
    AXES,
    Coords,
    RankTraffic,
    data_rank,
    group_name,
    replica_rank,
    shard_rank,
)
from paratrain.plan.rank_memory import (
    chunk_params,
    exact,
    flat_buffers,
    tied_root,
)
from paratrain.plan.rank_muon import muon_terms
from paratrain.plan.runtime_scalars import runtime_scalars
from paratrain.plan.tied_traffic import tied_ends_terms

__all__ = ["AXES", "Coords", "RankTraffic", "bytes_by_axis", "rank_traffic"]
REDUCE_BYTES = 4  # the runtime reduces gradients over dp in fp32, whatever the compute dtype
# A stand-in cluster: links only label entries; per-rank bytes do not depend on them.
ONE_NODE = ClusterSpec("one node", 1 << 20, 1 << 20, 1e18, 1, 1, 0, 0, 1, 1)


def _zero_traffic(
    model: ModelSpec, workload: Workload, layout: Layout, microbatches: int, at: Coords
) -> list[RankTraffic]:
    """comm.dp_traffic's ZeRO formulas per flat buffer (S padded to a multiple of k).

    The runtime reduces gradients in fp32 (MixedPrecision.reduce_dtype) and all-gathers
    parameters in their own dtype. ZeRO-1, and ZeRO-2 with accumulate "full" (the
    default), accumulate the whole gradient over the K micro-batches and reduce-scatter once
    per step: 2 (k - 1) S / k; ZeRO-2 with accumulate "shard" reduce-scatters after every
    micro-batch: (K + 1) (k - 1) S / k. ZeRO-3 gathers each unit for forward and again for
    backward and reduce-scatters it after every backward: 3 (k - 1) S / k per micro-batch,
    except the root unit of a tied table (`tied_root`), kept gathered from forward to its
    gradient: 2 (k - 1) S / k.
    """
    lora, stage = workload.lora is not None, at.stage  # LoRA: the adapters' buffers only
    base = flat_buffers(model, layout, stage)
    chunks = lora_chunks(model, layout, stage, workload) if lora else base
    root = 0 if lora else tied_root(model, layout, stage)
    tensors = None if lora else chunk_tensors(model, layout, stage)  # ZeRO-1/2's codec's buckets
    out = _buffers_traffic(
        chunks, root, workload, layout, microbatches, tensors, shard_rank(layout, at)
    )
    if lora:  # and ZeRO-3's gathers of the frozen base
        out += frozen_gathers(model, workload, layout, microbatches, stage)
    return out + _across_replicas(chunks, workload, layout, at)


def _across_replicas(
    chunks: list[list[int]], workload: Workload, layout: Layout, at: Coords
) -> list[RankTraffic]:
    """HSDP: each wrapper (one per chunk) all-reduces its gradient shards, ceil(n / k) of
    each flat buffer over the k ranks of a replica group, in fp32 (or --compress's codec)
    over the R replica groups, once per step (parallel/data_parallel/hybrid.py)."""
    r, k, at_r = layout.replicas, layout.shard_ranks, replica_rank(layout, at)
    if r == 1:
        return []
    shards = [sum(-(-n // k) for n in chunk) for chunk in chunks]
    sent = sum(compressed.gradient_all_reduce_bytes(n, workload, r, at_r) for n in shards)
    return [RankTraffic("dp_replicate", "all_reduce", comm.ACROSS_REPLICAS, sent)]


def _buffers_traffic(
    chunks: list[list[int]],
    root: int,
    workload: Workload,
    layout: Layout,
    microbatches: int,
    tensors: list[list[int]] | None = None,
    position: int = 0,
) -> list[RankTraffic]:
    """`_zero_traffic` of flat buffers of these sizes, per chunk (a root unit first);
    ZeRO-1/2's codec per bucket of each chunk's `tensors` (one bucket if not given) at the
    rank's `position` in its shard group."""
    runtime = replace(workload, precision=replace(workload.precision, grad_bytes=REDUCE_BYTES))
    layout_k = Layout(dp=layout.shard_ranks, zero=layout.zero)
    sent: dict[tuple[str, str], int] = {}
    for c, chunk in enumerate(chunks):
        for i, n in enumerate(chunk):
            buffer = ModelSpec("flat buffer", n_params=n)
            for e in comm.dp_traffic(buffer, runtime, layout_k, ONE_NODE, microbatches):
                if root and i == 0 and e.what == "parameters for backward":
                    continue  # the root unit (first in its chunk) is not gathered again
                nbytes = e.bytes
                if e.op == "reduce_scatter" and compressed.codec(workload) and layout.replicas == 1:
                    times = microbatches if workload.zero2_accumulate == "shard" else 1
                    times = times if layout.zero == 2 else 1
                    parts = tensors[c] if tensors else [n]  # ZeRO-1/2: one buffer a chunk
                    nbytes = times * compressed.gradient_reduce_scatter_bytes(
                        parts, workload, layout_k.dp, position
                    )
                sent[(e.op, e.what)] = sent.get((e.op, e.what), 0) + nbytes
    dp = group_name("dp_shard", layout)
    return [RankTraffic(dp, op, what, nbytes) for (op, what), nbytes in sent.items()]


def _dp_gradients(
    model: ModelSpec, workload: Workload, layout: Layout, microbatches: int, at: Coords
) -> list[RankTraffic]:
    k = layout.data_ranks  # the dp_cp group: the cp ranks hold the same parameters
    if k == 1:
        return []
    if layout.zero:
        return _zero_traffic(model, workload, layout, microbatches, at)
    # One all-reduce per bucket (a ring rounds each call on its own); LoRA's adapters, or
    # a model given by its count: one per chunk (exact for one bucket per chunk).
    if workload.lora is not None:
        calls = [sum(c) for c in lora_chunks(model, layout, at.stage, workload)]
    elif exact(model):
        calls = gradient_buckets(model, workload, layout, at)
    else:
        calls = chunk_params(model, layout, at.stage)
    rank = data_rank(layout, at)
    sent = sum(compressed.gradient_all_reduce_bytes(n, workload, k, rank) for n in calls)
    return [RankTraffic(group_name("dp_cp", layout), "all_reduce", "gradients", sent)]


def _share_gradients(
    model: ModelSpec,
    experts: ExpertCounts,
    workload: Workload,
    layout: Layout,
    microbatches: int,
    at: Coords,
) -> list[RankTraffic]:
    """A mixture of experts: each share's gradients over its own group (rank_experts.py)."""
    out = []
    for share in shares(model, experts, layout, at):
        lay, within = share_layout(share, layout), Coords(dp_rank=share.rank)
        # ZeRO's over the share's part of a replica group (its group without HSDP)
        name = group_name(share.shard_kind if layout.zero else share.kind, layout)
        if layout.zero and share.size > 1:  # per flat buffer: ZeRO-3's units
            terms = _buffers_traffic([share.flat], share.root, workload, lay, microbatches)
            terms += _across_replicas([share.flat], workload, lay, within)
        else:
            spec = ModelSpec(f"{share.kind} share", n_params=share.params)
            terms = _dp_gradients(spec, workload, lay, microbatches, within)
        for t in terms:
            what = t.what if share.kind == "dp_cp" else "expert " + t.what
            axis = t.axis if t.axis == "dp_replicate" else name
            out.append(replace(t, axis=axis, what=what))
    return out


def _tp_terms(
    model: ModelSpec,
    workload: Workload,
    layout: Layout,
    microbatches: int,
    at: Coords,
    dropout: float,
) -> list[RankTraffic]:
    sequence_parallel = layout.sequence_parallel
    plain = replace(workload, recompute="none")
    out = [
        RankTraffic("tp", e.op, e.what, e.bytes)
        for e in comm.tp_traffic(model, plain, layout, ONE_NODE, microbatches, at.stage)
    ]
    if layout.tp == 1:
        return out
    t, size = layout.tp, comm.activation_message_bytes(model, workload, layout.cp)
    if workload.recompute != "none":  # full and selective repeat the same collectives
        n, pp, v = model.shape.n_layer, layout.pp, layout.chunks
        layers = recomputed_layers(n, at.stage, pp, v, layout.schedule)  # ZB-H1's: twice
        # Half all-reduces (an all-gather or a reduce-scatter) repeated per block: module
        # docstring; with sequence parallelism the all-gathers before q, k, v and the MLP too.
        halves = 4 if dropout else (3 if sequence_parallel else 2)
        sent = microbatches * layers * halves * comm.reduce_scatter_bytes(size, t)
        out.append(RankTraffic("tp", "all_reduce", "recomputed forward", sent))
    if sequence_parallel or workload.lora is not None:  # partial gradients: held_pieces.py
        n = held_unsplit(model, workload, layout, at.stage, shard_rank(layout, at))
        sent = comm.ring_all_reduce_rank_bytes(n, workload.precision.grad_bytes, t, at.tp_rank)
        what = "gradient sum of the parameters whole on every tp rank (sequence parallel, LoRA)"
        out.append(RankTraffic("tp", "all_reduce", what, sent))
    return out


def rank_traffic(
    model: ModelSpec,
    workload: Workload,
    layout: Layout,
    microbatches: int,
    at: Coords,
    dropout: float = 0.0,
    experts: ExpertCounts | None = None,
) -> list[RankTraffic]:
    """Everything a rank sends per optimizer step: the planner's terms, then bookkeeping.

    `experts`: a mixture of experts (rank_experts.py), with `model` the dense model of
    the same shape; its shares replace the one gradient set, its MoE blocks the MLP's tp
    all-reduces, and its routing and expert traffic is added."""
    if experts is None:  # PowerSGD's gradients replaced where priced (rank_compress.py)
        out = _dp_gradients(model, workload, layout, microbatches, at)
        out = compressed.powersgd_terms(out, model, workload, layout, microbatches, at)
    else:
        out = _share_gradients(model, experts, workload, layout, microbatches, at)
    if layout.tp > 1 or layout.pp > 1:
        tp = _tp_terms(model, workload, layout, microbatches, at, dropout)
        if experts is not None and tp:  # the first term is the activations' all-reduces
            sent = tp_activation_bytes(model, workload, layout, microbatches, at.stage)
            tp[0] = replace(tp[0], bytes=sent)
        if workload.lora is not None:
            tp = lora_tp_terms(tp, model, workload, layout, microbatches, at)
        out += tp
        for e in comm.pp_traffic(model, workload, layout, ONE_NODE, microbatches, at.stage):
            out.append(RankTraffic("pp", e.op, e.what, e.bytes))
    out += cp_terms(model, workload, layout, microbatches, at.stage)
    out += tied_ends_terms(model, workload, layout, at)
    if workload.muon_ns_bytes:
        out += muon_terms(model, workload, layout, at, dense_moe(experts, layout.ep))
    if experts is not None:
        out += moe_terms(model, experts, workload, layout, microbatches, at)
    return out + runtime_scalars(layout, at, experts is not None)


def bytes_by_axis(terms: list[RankTraffic], bookkeeping: bool = True) -> dict[str, int]:
    """{group: bytes per step} for every group of AXES; without bookkeeping, the
    planner's terms only."""
    return {
        axis: sum(t.bytes for t in terms if t.axis == axis and (bookkeeping or not t.bookkeeping))
        for axis in AXES
    }
