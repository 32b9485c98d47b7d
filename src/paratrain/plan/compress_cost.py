"""--compress in `paratrain plan`'s cluster estimates: the gradients' bytes and the error
buffers of one GPU, from the per-rank formulas (plan/rank_compress.py, codec_bytes.py,
rank_powersgd.py) at the estimates' resolution, one flat buffer of n = N / (tp pp) local
parameters per GPU (plan/comm.py `dp_traffic`).

What changes: without HSDP, the gradients' all-reduce (ZeRO-0) or reduce-scatter (ZeRO-1
and 2, each time it reduces) over the data-parallel group, in the codec, or as PowerSGD's
two float32 all-reduces of its factors beside the exact elements; under HSDP only the
all-reduce of the shard across the groups (int8 or sign). The parameters' all-gathers and
everything else stay. The time a codec or a QR takes is not modelled (a few passes over
the gradient, against the bytes it saves on a slow link). Memory: the error of every
element a GPU reduces compressed, 4 bytes each, as gradients; PowerSGD's Q factors too.
"""

from __future__ import annotations

import math
from dataclasses import replace

from paratrain.plan import comm, moe
from paratrain.plan.cluster import ClusterSpec
from paratrain.plan.comm import ACROSS_REPLICAS, CommEntry
from paratrain.plan.layout import Layout, Workload
from paratrain.plan.memory import local_params
from paratrain.plan.model import ModelSpec
from paratrain.plan.rank_compress import (
    codec_state_bytes,
    gradient_all_reduce_bytes,
    gradient_reduce_scatter_bytes,
    powersgd_state_bytes,
)
from paratrain.plan.rank_powersgd import local_matrices, powersgd_bytes

REDUCTIONS = ("gradients", "gradients, every micro-batch", "gradients, once per step")


def compressed_traffic(
    model: ModelSpec, workload: Workload, layout: Layout, cluster: ClusterSpec, k_mb: int
) -> list[CommEntry]:
    """plan/comm.py `traffic`, with the reductions --compress sends in its way; `k_mb`:
    micro-batches per step."""
    entries = comm.traffic(model, workload, layout, cluster, k_mb)
    if workload.compress == "none" or layout.data_ranks == 1:
        return entries
    return [_compressed(e, model, workload, layout, k_mb) for e in entries]


def _compressed(
    e: CommEntry, model: ModelSpec, workload: Workload, layout: Layout, k_mb: int
) -> CommEntry:
    expert = e.what.startswith("expert ")
    what = e.what.removeprefix("expert ")
    n, k = _elements(model, layout, expert)
    method = workload.compress
    if layout.replicas > 1 and layout.zero and what == ACROSS_REPLICAS and method != "powersgd":
        shard, r = math.ceil(n / (k // layout.replicas)), layout.replicas
        nbytes = gradient_all_reduce_bytes(shard, workload, r, 0)
    elif layout.replicas == 1 and what in REDUCTIONS:
        times = k_mb if what.endswith("micro-batch") else 1
        nbytes = times * _reduction_bytes(n, k, model, workload, layout)
        if method == "powersgd":  # two all-reduces where there was one reduction
            steps = 2 if e.op == "all_reduce" else 4  # ring steps per reduction, twice
            return replace(e, op="all_reduce", what=f"{e.what} ({method})", bytes=nbytes,
                           messages=e.messages * steps)  # fmt: skip
    else:
        return e
    return replace(e, what=f"{e.what} ({method})", bytes=nbytes)


def _elements(model: ModelSpec, layout: Layout, expert: bool) -> tuple[int, int]:
    """Local parameters and the group size of the dense set, or of the experts."""
    experts = moe.all_expert_params(model)
    if expert:
        n = local_params(experts // layout.ep, layout.tp, layout.pp)
        return n, layout.data_ranks // layout.ep
    return local_params(model.params - experts, layout.tp, layout.pp), layout.data_ranks


def _reduction_bytes(n: int, k: int, model: ModelSpec, workload: Workload, layout: Layout) -> int:
    """One compressed reduction of a GPU's buffer of n elements over k GPUs, as rank 0 of
    the per-rank counts sends it (rank_compress.py)."""
    if workload.compress == "powersgd":
        padded = n if layout.zero == 0 else math.ceil(n / k) * k
        matrices = [m for chunk in local_matrices(model, layout, 0) for m in chunk]
        return powersgd_bytes(padded, matrices, workload.compress_rank, k, 0)
    if layout.zero == 0:
        return gradient_all_reduce_bytes(n, workload, k, 0)
    return gradient_reduce_scatter_bytes([n], workload, k, 0)  # one bucket: a GPU's buffer whole


def gpu_compress_bytes(model: ModelSpec, workload: Workload, layout: Layout) -> int:
    """One GPU's error buffers (and PowerSGD's factors), dense and expert sets alike, as
    rank 0's of the per-rank counts (rank_compress.py)."""
    if workload.compress == "none" or layout.data_ranks == 1:
        return 0
    if workload.compress == "powersgd":  # a dense model (paratrain plan refuses experts)
        n, k = _elements(model, layout, False)
        size = n if layout.zero == 0 else math.ceil(n / k) * k
        matrices = local_matrices(model, layout, 0)
        return powersgd_state_bytes([size], matrices, workload.compress_rank)
    sets = [_elements(model, layout, expert) for expert in (False, True)]
    return sum(codec_state_bytes([n], layout.zero, k, 0, layout.replicas) for n, k in sets if n)


def compress_problems(workload: Workload, layout: Layout) -> list[str]:
    """Why `paratrain train` would refuse --compress on this layout (validate/
    rules_compression.py), so that a search passes it over."""
    method = workload.compress
    if method == "none" or layout.data_ranks == 1:
        return []
    if layout.zero == 3:
        return [f"--compress {method} with ZeRO-3: refused (FSDP frees each unit's gradient)"]
    if method == "powersgd" and layout.replicas > 1:
        return ["--compress powersgd across HSDP's groups: refused (flat shards, not matrices)"]
    return []
