"""--compress int8 or sign on each rank (parallel/data_parallel/compression.py): what a
rank sends for its gradients and the state it keeps, per wrapper (one per chunk), exact
for one bucket per wrapper as the synchronous counts are (plan/rank_traffic.py).

Traffic, in the codec (plan/codec_bytes.py):
- data parallelism (and ZeRO-0): a mean over the k ranks of dp_cp, a reduce-scatter and an
  all-gather of encoded chunks, in place of the float32 ring all-reduce;
- ZeRO-1/2: the reduce-scatter alone, of the padded buffer's k equal shards, once per step
  or, ZeRO-2 accumulating per micro-batch, K times; the parameters' all-gather unchanged;
- HSDP: within a replica group exact; across the R groups the mean of the rank's shard.
State, float32, counted as gradients: the error of every element the rank reduces
compressed (the whole buffer; under HSDP its shard) and, where its mean is encoded again
for an all-gather, the second rounding's error of the chunk it owns.

PowerSGD (plan/rank_powersgd.py): per wrapper two float32 all-reduces of the factors and
the exact elements, in place of the all-reduce (DP) or the reduce-scatter (ZeRO-1/2, each
time it reduces); state: the errors as above (no second rounding) and each approximated
matrix's Q. Our GPT and Llama only: with experts or LoRA's adapters a note says that the
prediction leaves PowerSGD out.
"""

from __future__ import annotations

from paratrain.plan import comm
from paratrain.plan.codec_bytes import (
    codec_all_reduce_bytes,
    codec_mean_peak_bytes,
    codec_reduce_scatter_bytes,
)
from paratrain.plan.grad_buckets import chunk_tensors, gradient_buckets, sharded_buckets
from paratrain.plan.layout import Layout, Workload, microbatches_for
from paratrain.plan.lora_traffic import lora_chunks
from paratrain.plan.model import ModelSpec
from paratrain.plan.muon import Matrix
from paratrain.plan.rank_experts import ExpertCounts, shares
from paratrain.plan.rank_groups import Coords, RankTraffic, data_rank, group_name
from paratrain.plan.rank_memory import chunk_params, exact, flat_buffers
from paratrain.plan.rank_powersgd import (
    factor_bytes,
    local_matrices,
    powersgd_bytes,
    powersgd_flops,
)

CODECS = ("int8", "sign")
ERROR_BYTES = 4  # float32
POWERSGD_NOTE = "--compress powersgd: not predicted with experts or LoRA (counted uncompressed)"


def codec(workload: Workload) -> str | None:
    """The codec --compress sends the step's gradients in, None when it sends none (also
    before --compress-start: `Workload.compress_idle`)."""
    idle = workload.compress_idle
    return workload.compress if workload.compress in CODECS and not idle else None


def gradient_all_reduce_bytes(numel: int, workload: Workload, k: int, rank: int) -> int:
    """A gradient all-reduce of `numel` float32 elements over k ranks, as `rank` sends it."""
    name = codec(workload)
    if name is None:
        return comm.ring_all_reduce_rank_bytes(numel, ERROR_BYTES, k, rank)
    return codec_all_reduce_bytes(numel, name, k, rank)


def gradient_reduce_scatter_bytes(
    tensors: list[int], workload: Workload, k: int, position: int
) -> int:
    """ZeRO-1/2's compressed reduce-scatters of a flat buffer holding `tensors` (elements
    each, in order; padded to k ceil(n / k)): per bucket (grad_buckets.py) each rank's part
    of it to its owner, every part encoded on its own, so each bucket rounds its parts'
    codes and scale blocks. `position`: the rank's place among the k."""
    name = codec(workload)
    assert name is not None
    buckets = sharded_buckets(tensors, workload, k)
    return sum(codec_reduce_scatter_bytes(parts, name, position) for parts in buckets)


def compress_state_bytes(
    model: ModelSpec,
    workload: Workload,
    layout: Layout,
    at: Coords,
    experts: ExpertCounts | None = None,
) -> int:
    """The rank's error buffers (and PowerSGD's factors), in bytes, over every wrapper:
    one per chunk, and with experts one per share (the module docstring)."""
    k = layout.data_ranks
    if powersgd_predicted(model, workload) and experts is None and k > 1:
        sizes = _bucket_sizes(model, layout, at.stage)
        matrices = local_matrices(model, layout, at.stage)
        return powersgd_state_bytes(sizes, matrices, workload.compress_rank)
    if workload.compress not in CODECS:  # kept from the first step, compressing or not
        return 0
    if experts is not None:
        return sum(
            codec_state_bytes(share.flat, layout.zero, share.size, share.rank, layout.replicas)
            for share in shares(model, experts, layout, at)
        )
    if workload.lora is not None:
        chunks = [sum(c) for c in lora_chunks(model, layout, at.stage, workload)]
    elif layout.zero:
        chunks = [sum(c) for c in flat_buffers(model, layout, at.stage)]
    else:
        chunks = chunk_params(model, layout, at.stage)
    rank = data_rank(layout, at)
    return sum(codec_state_bytes([n], layout.zero, k, rank, layout.replicas) for n in chunks)


def powersgd_state_bytes(sizes: list[int], matrices: list[list[Matrix]], rank: int) -> int:
    """Wrappers' errors for reduced buffers of `sizes` and the Q of each approximated
    matrix among `matrices` (per buffer)."""
    return ERROR_BYTES * sum(sizes) + sum(factor_bytes(m, rank) for m in matrices)


def codec_state_bytes(flat: list[int], zero: int, k: int, rank: int, replicas: int) -> int:
    """A wrapper's errors over k ranks (rank `rank` of them) for buffers of `flat` elements:
    whole with the owned chunk's (all-reduced), ZeRO-1/2's padded buffer (reduce-scattered),
    or under HSDP the shard with its owned chunk across the groups."""
    if k == 1:
        return 0
    if zero == 0:
        return sum(ERROR_BYTES * (n + comm.chunk_elements(n, k)[rank]) for n in flat)
    if replicas == 1:
        return sum(ERROR_BYTES * -(-n // k) * k for n in flat)
    s = k // replicas
    shard = sum(-(-n // s) for n in flat)  # the wrapper's shards, reduced as one buffer
    return ERROR_BYTES * (shard + comm.chunk_elements(shard, replicas)[rank // s])


def compress_reduce_bytes(model: ModelSpec, workload: Workload, layout: Layout, stage: int) -> int:
    """A compressed bucket's reduction at its peak, after backward, at the largest bucket
    (compression.py `reduce`). PowerSGD's (powersgd.py `powersgd_mean`): three float32
    copies, the gradient plus its error, the approximate mean and the new error (P and Q
    are smaller). A codec's: its chunks' bytes and one chunk's decoding
    (codec_bytes.py `codec_mean_peak_bytes`). Under ZeroDataParallel (ZeRO-1/2, or mixed
    precision) the bucket's launch is beside them: ZeRO-2's bucket and, where gradients
    are narrower, their float32 copy (zero.py `_launch`). Without them the planner's peak
    was under the measured one by 14.2% (gpt-tiny over dp 4), 17.4% (ZeRO-2) and 12.5%
    (llama-tiny in bf16) with PowerSGD; with int8, 3.9% (gpt-tiny over dp 4; 36.9%
    before the reduction held fewer float32 copies). 0 without compression."""
    buckets = _compressed_buckets(model, workload, layout, stage)
    return max((_reduction_bytes(b, workload, layout, True) for b in buckets), default=0)


def first_compressed_bucket_bytes(
    model: ModelSpec, workload: Workload, layout: Layout, stage: int
) -> int:
    """The first bucket's reduction, which backward runs beside the activations of every
    block but part of one where that bucket is smaller than a block (0 otherwise, and
    where it is also the last, reduced as backward ends); ZeRO-2's bucket itself is
    already beside them (rank_peak.py zero2_bucket_bytes). gpt-tiny's ZeRO-2 with int8
    and 0.25 MiB buckets: +7.3% without it."""
    buckets = _compressed_buckets(model, workload, layout, stage)
    block = sum(n for n, _ in model.tensors(layout.tp).block)
    if len(buckets) < 2 or sum(buckets[0]) >= block:
        return 0
    return _reduction_bytes(buckets[0], workload, layout, False)


def _compressed_buckets(
    model: ModelSpec, workload: Workload, layout: Layout, stage: int
) -> list[list[int]]:
    """The buckets a rank reduces compressed, in launch order, as the pieces their
    reduction gives each rank (one piece where it is an all-reduce); none where the
    counts here do not price the compression (HSDP's compression takes its own path)."""
    powersgd = powersgd_predicted(model, workload)
    if not (powersgd or codec(workload)) or layout.data_ranks == 1:
        return []
    if layout.zero == 3 or layout.replicas > 1:
        return []
    if layout.zero == 0 and workload.precision.grad_bytes == ERROR_BYTES:  # DataParallel's
        return [[n] for n in gradient_buckets(model, workload, layout, Coords(stage=stage))]
    k = layout.data_ranks if layout.zero else 1
    return [b for c in chunk_tensors(model, layout, stage) for b in sharded_buckets(c, workload, k)]


def _reduction_bytes(pieces: list[int], workload: Workload, layout: Layout, own: bool) -> int:
    """One bucket's compressed reduction at its largest, with its launch under
    ZeroDataParallel: the float32 copy of narrower gradients and, `own`, ZeRO-2's bucket."""
    grad, n = workload.precision.grad_bytes, sum(pieces)
    launch = 0
    if layout.zero or grad != ERROR_BYTES:  # ZeroDataParallel
        bucket = own and layout.zero == 2 and workload.zero2_accumulate == "shard"
        launch = grad * bucket + ERROR_BYTES * (grad != ERROR_BYTES)
    name = codec(workload)
    if name is None:  # PowerSGD
        return n * (3 * ERROR_BYTES + launch)
    if layout.zero:
        return n * launch + codec_mean_peak_bytes(pieces, name, gathered=False)
    chunks = comm.chunk_elements(n, layout.data_ranks)
    return n * launch + codec_mean_peak_bytes(chunks, name, gathered=True)


def powersgd_predicted(model: ModelSpec, workload: Workload) -> bool:
    """Whether the counts here price PowerSGD (the module docstring)."""
    return workload.compress == "powersgd" and exact(model) and workload.lora is None


def _bucket_sizes(model: ModelSpec, layout: Layout, stage: int) -> list[int]:
    """Each wrapper's reduced buffer: its chunk, or ZeRO-1/2's padded flat buffer."""
    if layout.zero == 0:
        return chunk_params(model, layout, stage)
    k = layout.data_ranks
    return [-(-sum(c) // k) * k for c in flat_buffers(model, layout, stage)]


def powersgd_terms(
    terms: list[RankTraffic],
    model: ModelSpec,
    workload: Workload,
    layout: Layout,
    microbatches: int,
    at: Coords,
) -> list[RankTraffic]:
    """`terms` with the gradients' reductions over the data-parallel group replaced by
    PowerSGD's all-reduces, where the counts price it."""
    k = layout.data_ranks
    if not powersgd_predicted(model, workload) or k == 1 or workload.compress_idle:
        return terms
    rank, r = data_rank(layout, at), workload.compress_rank
    matrices = local_matrices(model, layout, at.stage)
    sizes = _bucket_sizes(model, layout, at.stage)
    per = sum(powersgd_bytes(n, m, r, k, rank) for n, m in zip(sizes, matrices, strict=True))
    shard = layout.zero == 2 and workload.zero2_accumulate == "shard"
    sent = per * (microbatches if shard else 1)
    kept = [t for t in terms if not t.what.startswith("gradients")]
    axis = group_name("dp_cp" if layout.zero == 0 else "dp_shard", layout)
    return [RankTraffic(axis, "all_reduce", "gradients (PowerSGD)", sent), *kept]


def compress_flops(model: ModelSpec, workload: Workload, layout: Layout, at: Coords) -> int:
    """PowerSGD's products on the rank per step, where the counts price it (else 0)."""
    if not powersgd_predicted(model, workload) or layout.data_ranks == 1:
        return 0
    if workload.compress_idle:
        return 0
    shard = layout.zero == 2 and workload.zero2_accumulate == "shard"
    reductions = microbatches_for(workload, layout) if shard else 1
    return powersgd_flops(model, layout, workload.compress_rank, at.stage, reductions)
