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

PowerSGD's bytes follow each matrix's shape, which these counts do not carry: a run with
--compress powersgd is predicted as an uncompressed one, and its summary says so.
"""

from __future__ import annotations

from paratrain.plan import comm
from paratrain.plan.codec_bytes import codec_all_reduce_bytes, codec_reduce_scatter_bytes
from paratrain.plan.layout import Layout, Workload
from paratrain.plan.model import ModelSpec
from paratrain.plan.rank_groups import Coords, data_rank, replica_rank
from paratrain.plan.rank_memory import chunk_params, flat_buffers

CODECS = ("int8", "sign")
ERROR_BYTES = 4  # float32
POWERSGD_NOTE = "--compress powersgd: its bytes and factors not predicted (they follow shapes)"


def codec(workload: Workload) -> str | None:
    """The codec --compress sends gradients in, None when it sends none."""
    return workload.compress if workload.compress in CODECS else None


def gradient_all_reduce_bytes(numel: int, workload: Workload, k: int, rank: int) -> int:
    """A gradient all-reduce of `numel` float32 elements over k ranks, as `rank` sends it."""
    name = codec(workload)
    if name is None:
        return comm.ring_all_reduce_rank_bytes(numel, ERROR_BYTES, k, rank)
    return codec_all_reduce_bytes(numel, name, k, rank)


def gradient_reduce_scatter_bytes(numel: int, workload: Workload, k: int, rank: int) -> int:
    """ZeRO-1/2's compressed reduce-scatter of a buffer of `numel` (padded to k ceil(n/k))
    elements: each rank's equal shard to its owner."""
    name = codec(workload)
    assert name is not None
    return codec_reduce_scatter_bytes([-(-numel // k)] * k, name, rank)


def compress_state_bytes(model: ModelSpec, workload: Workload, layout: Layout, at: Coords) -> int:
    """The rank's error buffers, in bytes (the module docstring)."""
    name, k = codec(workload), layout.data_ranks
    if name is None or k == 1:
        return 0
    if layout.zero == 0:  # whole chunks, each all-reduced
        chunks = chunk_params(model, layout, at.stage)
        rank = data_rank(layout, at)
        return sum(ERROR_BYTES * (n + comm.chunk_elements(n, k)[rank]) for n in chunks)
    buffers = [sum(c) for c in flat_buffers(model, layout, at.stage)]
    if layout.replicas == 1:  # the padded buffer, reduce-scattered
        return sum(ERROR_BYTES * -(-n // k) * k for n in buffers)
    s, r = layout.shard_ranks, layout.replicas
    shards = [-(-n // s) for n in buffers]
    owned = [comm.chunk_elements(n, r)[replica_rank(layout, at)] for n in shards]
    return ERROR_BYTES * (sum(shards) + sum(owned))
