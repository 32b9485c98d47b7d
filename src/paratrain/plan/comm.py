"""Bytes each GPU sends per optimizer step, by collective, axis and link.

Per-rank volumes of bandwidth-optimal (ring) algorithms on k ranks and S bytes
(Patarasuk and Yuan 2009; Thakur et al. 2005): reduce-scatter and all-gather each send
(k - 1) S / k; all-reduce is one of each, 2 (k - 1) S / k (seeds, result 9.2.1). The
counts match `paratrain.comm.traffic.native_traffic`, which is what the runtime records.

Where the seeds are loose this follows the primary papers (docs/seed-notes.md):
- ZeRO-1 and ZeRO-2 reduce-scatter gradients and all-gather updated parameters:
  2 (k - 1) S / k, the same as DDP; ZeRO-3 adds a second parameter gather, 3 (k - 1) S / k
  (ZeRO, arXiv:1910.02054, section 7). S is the flat buffer padded to a multiple of k, so
  (k - 1) S / k = (k - 1) ceil(n / k) elements exactly. ZeRO-3 keeps no whole gradient,
  so it reduce-scatters after every micro-batch. ZeRO-2 with K micro-batches follows
  `Workload.zero2_accumulate`: "shard" (the default, the runtime's and DeepSpeed's)
  reduce-scatters after every micro-batch into the shard: K (k - 1) S / k + (k - 1) S / k;
  "full" holds the whole gradient until the last micro-batch and reduce-scatters once,
  2 (k - 1) S / k per step, paid in memory (memory.py's `grad_accumulation`).
- Megatron tensor parallelism (arXiv:1909.08053, section 3) does not all-gather between
  the column- and row-parallel layers: per layer one all-reduce of the b s h activation
  after attention and one after the MLP in forward, two more in backward (and two more
  with full recomputation, which reruns the forward: arXiv:2205.05198, section 5; our
  selective recomputation reruns them too, since it recomputes the collectives between
  the kept matmuls: parallel/recompute.py). The
  vocabulary-parallel cross-entropy adds 3 fp32 numbers per token (two all-reduces).

Traffic is for the busiest GPU by default; `stage=` gives one pipeline stage's exactly
(plan/rank_traffic.py builds every rank's prediction from these).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from paratrain.plan import moe
from paratrain.plan.cluster import ClusterSpec
from paratrain.plan.layout import Layout, Workload
from paratrain.plan.memory import local_params
from paratrain.plan.model import ModelSpec
from paratrain.plan.pipeline import stage_virtual_stages, virtual_stage_layers

ACROSS_REPLICAS = "gradient shards across replica groups"  # HSDP's all-reduce (hybrid.py)
# The groups that carry data-parallel gradients (dense and experts', with HSDP's parts)
GRADIENT_AXES = ("dp", "expert_dp", "dp_shard", "expert_shard", "dp_replicate")
LOSS_STAT_BYTES = 12  # per token: the max (fp32), then sum of exp and the target logit (fp32)


@dataclass(frozen=True)
class CommEntry:
    op: str  # all_reduce, reduce_scatter, all_gather, send
    axis: str  # dp, tp or pp
    link: str  # intra (NVLink, inside a node) or inter (InfiniBand, between nodes)
    what: str  # what moves, e.g. "gradients"
    bytes: int  # sent by one GPU per optimizer step
    messages: int  # point-to-point messages one GPU sends per step (latency terms)

    def as_dict(self) -> dict[str, int | str]:
        return asdict(self)


def all_reduce_bytes(nbytes: int, k: int) -> int:
    """Ring all-reduce, per rank: 2 (k - 1) S / k (reduce-scatter then all-gather)."""
    return 2 * (k - 1) * nbytes // k


def reduce_scatter_bytes(nbytes: int, k: int) -> int:
    """Ring reduce-scatter (or all-gather of the same full size), per rank: (k - 1) S / k."""
    return (k - 1) * nbytes // k


def ring_all_reduce_rank_bytes(numel: int, elem_bytes: int, k: int, rank: int) -> int:
    """What rank `rank` of k sends in a ring all-reduce of `numel` elements, exactly.

    The tensor is cut into k chunks, the first numel % k one element larger (torch's
    tensor_split, as comm/traffic.py); the reduce-scatter sends every chunk but the
    rank's own, the all-gather every chunk but the next rank's. 2 (k - 1) S / k when k
    divides numel.
    """
    if k == 1:
        return 0
    chunks = [n * elem_bytes for n in chunk_elements(numel, k)]
    total = numel * elem_bytes
    return (total - chunks[rank]) + (total - chunks[(rank + 1) % k])


def chunk_elements(numel: int, k: int) -> list[int]:
    """numel elements cut into k chunks, the first numel % k one larger: torch's
    tensor_split, as the runtime cuts them (comm/traffic.py `chunk_sizes`)."""
    base, extra = divmod(numel, k)
    return [base + (1 if i < extra else 0) for i in range(k)]


def axis_link(axis: str, layout: Layout, cluster: ClusterSpec) -> str:
    """Whether a group of this axis fits in one node, given the order pp, dp, cp, tp
    (mesh.py): the ranks a group spans, first to last. The gradient group is dp_cp; an
    ep group is ep consecutive ranks of it (tp apart), expert_dp the rest of it."""
    t, c = layout.tp, layout.cp
    span = {
        "tp": t,
        "cp": t * c,
        "dp": t * c * layout.dp,
        "ep": t * layout.ep,
        "expert_dp": t * c * layout.dp,
        "dp_shard": t * c * layout.dp // layout.replicas,  # a run of consecutive dp ranks
        "expert_shard": t * c * layout.dp // layout.replicas,  # inside that run
        "dp_replicate": t * c * layout.dp,
        "pp": layout.world,
    }[axis]
    return "intra" if span <= cluster.gpus_per_node else "inter"


def dp_traffic(
    model: ModelSpec, workload: Workload, layout: Layout, cluster: ClusterSpec, microbatches: int
) -> list[CommEntry]:
    """Gradient (and for ZeRO, parameter) traffic over the dp_cp group of k = dp * cp
    ranks; a mixture of experts' expert parameters over the expert_dp group of k / ep
    (plan/moe.py), each with the same formulas. Under HSDP (`Layout.replicas` R > 1) ZeRO
    runs over a replica group of k / R ranks ("dp_shard"), and each rank all-reduces its
    gradient shard over the R groups once per step ("dp_replicate"); so do the experts,
    over the k / (R ep) ranks of a replica group holding the same ones ("expert_shard")."""
    experts = moe.all_expert_params(model)
    k, hsdp = layout.data_ranks, layout.replicas > 1 and layout.zero > 0
    r = layout.replicas if hsdp else 1
    entries = []
    for n, ranks, axis in [
        (model.params - experts, k // r, "dp_shard" if hsdp else "dp"),
        (experts // layout.ep, k // (r * layout.ep), "expert_shard" if hsdp else "expert_dp"),
    ]:
        if not n:
            continue
        entries += _sync_traffic(n, ranks, axis, model, workload, layout, cluster, microbatches)
        if hsdp:
            shard = math.ceil(local_params(n, layout.tp, layout.pp) / ranks)
            nbytes = all_reduce_bytes(workload.precision.grad_bytes * shard, r)
            link = axis_link("dp_replicate", layout, cluster)
            what = ("expert " if axis == "expert_shard" else "") + ACROSS_REPLICAS
            entries.append(CommEntry("all_reduce", "dp_replicate", link, what, nbytes, 2 * (r - 1)))
    return entries


def _sync_traffic(
    n_params: int,
    k: int,
    axis: str,
    model: ModelSpec,
    workload: Workload,
    layout: Layout,
    cluster: ClusterSpec,
    microbatches: int,
) -> list[CommEntry]:
    """One replicated set of `n_params` parameters kept in sync over k ranks."""
    if k == 1:
        return []
    n = local_params(n_params, layout.tp, layout.pp)
    grads = workload.precision.grad_bytes * n
    link = axis_link(axis, layout, cluster)
    prefix = "expert " if axis in ("expert_dp", "expert_shard") else ""
    buckets = max(1, math.ceil(grads / workload.bucket_bytes))
    units = (model.n_layer or 0) + 1  # ZeRO-3 / FSDP gathers one block (or the ends) at a time
    # ZeRO's flat buffer is padded to k ceil(n / k) elements (plan/memory.py), so with S the
    # padded size a rank sends (k - 1) S / k = (k - 1) ceil(n / k) elements, a whole number.
    shard = math.ceil(n / k)
    rs = (k - 1) * shard * workload.precision.grad_bytes
    ag = (k - 1) * shard * workload.precision.param_bytes

    def entry(op: str, what: str, nbytes: int, messages: int) -> CommEntry:
        return CommEntry(op, axis, link, prefix + what, nbytes, messages)

    if layout.zero == 0:
        return [entry("all_reduce", "gradients", all_reduce_bytes(grads, k), buckets * 2 * (k - 1))]
    m = microbatches
    if layout.zero in (1, 2):
        gather = entry("all_gather", "updated parameters", ag, buckets * (k - 1))
        if layout.zero == 2 and workload.zero2_accumulate == "shard":
            what, times = "gradients, every micro-batch", m
        else:  # ZeRO-1, and ZeRO-2 accumulating the whole gradient
            what, times = "gradients, once per step", 1
        return [entry("reduce_scatter", what, times * rs, times * buckets * (k - 1)), gather]
    return [
        entry("all_gather", "parameters for forward", m * ag, m * units * (k - 1)),
        entry("all_gather", "parameters for backward", m * ag, m * units * (k - 1)),
        entry("reduce_scatter", "gradients, every micro-batch", m * rs, m * units * (k - 1)),
    ]


def activation_message_bytes(model: ModelSpec, workload: Workload, cp: int = 1) -> int:
    """One micro-batch's hidden states b s h, the size of every TP and PP message; a cp
    rank holds s / cp of the tokens."""
    b, act = workload.micro_batch, workload.precision.activation_bytes
    return b * model.shape.seq_len // cp * model.shape.d_model * act


def tp_traffic(
    model: ModelSpec,
    workload: Workload,
    layout: Layout,
    cluster: ClusterSpec,
    microbatches: int,
    stage: int = 0,
) -> list[CommEntry]:
    """Megatron all-reduces over the tp group on pipeline stage `stage` (default the first).

    Per block 2 in forward and 2 in backward (6 with full or selective recomputation); the
    vocabulary-parallel embedding's output in forward on the stage holding the embedding,
    the head's input gradient in backward on the stage holding the head. That stage also
    runs the vocabulary-parallel cross-entropy: per token a max, then the sum of exp and
    the target's logit, 3 fp32 numbers in two all-reduces (never the V logits).
    """
    t = layout.tp
    if t == 1:
        return []
    s, v = layout.pp, layout.chunks
    mine = stage_virtual_stages(stage, s, v)
    pieces = virtual_stage_layers(model.shape.n_layer, s, v)
    layers = sum(pieces[vs] for vs in mine)
    has_head = s * v - 1 in mine
    per_layer = 4 if workload.recompute == "none" else 6  # selective too: module docstring
    ends = (0 in mine) + has_head
    calls = microbatches * (layers * per_layer + ends)
    size = activation_message_bytes(model, workload, layout.cp)
    link = axis_link("tp", layout, cluster)
    entries = [
        CommEntry(
            "all_reduce",
            "tp",
            link,
            "activations and their gradients",
            calls * all_reduce_bytes(size, t),
            calls * 2 * (t - 1),
        )
    ]
    if has_head:
        tokens = workload.micro_batch * model.shape.seq_len // layout.cp
        stats = all_reduce_bytes(4 * tokens, t) + all_reduce_bytes(8 * tokens, t)
        entries.append(
            CommEntry(
                "all_reduce",
                "tp",
                link,
                "loss statistics (vocabulary-parallel cross-entropy)",
                microbatches * stats,
                microbatches * 2 * 2 * (t - 1),
            )
        )
    return entries


def pp_traffic(
    model: ModelSpec,
    workload: Workload,
    layout: Layout,
    cluster: ClusterSpec,
    microbatches: int,
    stage: int | None = None,
) -> list[CommEntry]:
    """Activations forward and their gradients backward between neighbouring stages.

    Each chunk sends its output forward unless it is the last virtual stage, and its input
    gradient backward unless it is the first. A middle stage therefore sends 2 v K
    messages per step, the busiest (the default, stage None); the first and the last
    stage (2 v - 1) K, so with two stages every stage sends (2 v - 1) K. Each message is
    the full b s h tensor, or 1/t of it with Megatron's scatter/gather
    (`Workload.pp_scatter_gather`; the all-gather that rebuilds it runs on NVLink, not
    counted).
    """
    s, v = layout.pp, layout.chunks
    if s == 1:
        return []
    if stage is None:
        sends = microbatches * (2 * v - (1 if s == 2 else 0))
    else:
        last = s * v - 1
        mine = stage_virtual_stages(stage, s, v)
        sends = microbatches * sum((vs < last) + (vs > 0) for vs in mine)
    size = activation_message_bytes(model, workload, layout.cp)
    if workload.pp_scatter_gather:
        size = math.ceil(size / layout.tp)
    link = axis_link("pp", layout, cluster)
    return [CommEntry("send", "pp", link, "activations and gradients", sends * size, sends)]


def traffic(
    model: ModelSpec, workload: Workload, layout: Layout, cluster: ClusterSpec, microbatches: int
) -> list[CommEntry]:
    """All traffic of one GPU per step. TP and PP need the model's shape."""
    entries = dp_traffic(model, workload, layout, cluster, microbatches)
    if layout.tp > 1 or layout.pp > 1:
        if not model.has_shape:
            raise ValueError(
                f"{layout.label}: tensor and pipeline traffic need the model's shape "
                "(--layers --hidden --heads --vocab --seq-len)"
            )
        entries += tp_traffic(model, workload, layout, cluster, microbatches)
        entries += pp_traffic(model, workload, layout, cluster, microbatches)
    return entries
