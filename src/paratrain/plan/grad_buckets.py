"""The runtime's gradient buckets, as the planner counts them: how many collectives a
gradient reduction makes (rank_calls.py), and the elements each reduces, since a ring
all-reduce rounds each call's chunks on its own (rank_traffic.py).

Buckets are cut at parameters, so they need each parameter tensor of a chunk in
registration order (`ModelSpec.tensors`):
- DataParallel (no ZeRO, float32; parallel/data_parallel/buckets.py) fills buckets from
  the last parameter to the first, each up to the bucket size, the first up to 1 MiB
  (PyTorch DDP's first bucket); a parameter that would take a bucket over its cap starts
  the next one;
- ZeroDataParallel (ZeRO 0 in mixed precision, ZeRO-1, ZeRO-2; flat_buffer.py
  `flat_buckets`) lays the parameters out last first and cuts its flat buffer from its
  start, a bucket ending before the parameter that would take it over the bucket size,
  in the gradients' dtype; the last bucket also covers the buffer's padding (none at
  stage 0).
A bucket size of 0 (`ONE_BUCKET`) never cuts.
"""

from __future__ import annotations

from paratrain.plan.layout import ONE_BUCKET, Layout, Workload
from paratrain.plan.lora import adapter_tensors
from paratrain.plan.model import ModelSpec
from paratrain.plan.pipeline import stage_virtual_stages, virtual_stage_layers
from paratrain.plan.rank_groups import Coords

DDP_FIRST_BUCKET_BYTES = 2**20  # buckets.py FIRST_BUCKET_BYTES (PyTorch DDP's)


def chunk_tensors(model: ModelSpec, layout: Layout, stage: int) -> list[list[int]]:
    """Per chunk on `stage`, each parameter tensor's elements on this tp rank, in the
    order the chunk registers them: the first end's, the blocks', the last end's."""
    t, s, c = model.tensors(layout.tp), layout.pp, layout.chunks
    pieces = virtual_stage_layers(model.shape.n_layer, s, c)
    out = []
    for vs in stage_virtual_stages(stage, s, c):
        first, last = vs == 0, vs == s * c - 1
        tensors = [*(t.first if first else ()), *t.block * pieces[vs], *(t.last if last else ())]
        if first and last and model.tie_embeddings:
            tensors = tensors[:-1]  # the head is the token table: one parameter
        out.append([n for n, _ in tensors])
    return out


def trained_chunk_tensors(
    model: ModelSpec, workload: Workload, layout: Layout, stage: int
) -> list[list[int]]:
    """`chunk_tensors` of the parameters a chunk trains, which its gradient buffers hold:
    under LoRA each block's adapters alone (plan/lora.py), the base frozen."""
    if workload.lora is None:
        return chunk_tensors(model, layout, stage)
    per_block = [n for n, _ in adapter_tensors(model, workload.lora, layout.tp)]
    layers = virtual_stage_layers(model.shape.n_layer, layout.pp, layout.chunks)
    return [per_block * layers[vs] for vs in stage_virtual_stages(stage, layout.pp, layout.chunks)]


def ddp_bucket_sizes(numels: list[int], workload: Workload) -> list[int]:
    """DataParallel's buckets of one chunk's tensors (registration order): elements each,
    last bucket first."""
    cap, elem = workload.bucket_bytes, workload.precision.grad_bytes
    if cap == ONE_BUCKET:  # the runtime's bucket size 0: never cut, not even the first
        return [sum(numels)]
    buckets: list[int] = []
    size = 0
    for n in reversed(numels):
        limit = min(cap, DDP_FIRST_BUCKET_BYTES) if not buckets else cap
        if size and elem * (size + n) > limit:
            buckets.append(size)
            size = 0
        size += n
    return [*buckets, size] if size else buckets


def flat_bucket_sizes(numels: list[int], workload: Workload, padded: int = 0) -> list[int]:
    """ZeroDataParallel's buckets of a flat buffer of one chunk's tensors (`numels` in
    registration order; the buffer lays them out last first, zero.py, so that its buckets
    complete in backward's order), then padding to `padded` elements: elements each, in
    the buffer's order."""
    cap, elem = workload.bucket_bytes, workload.precision.grad_bytes
    buckets: list[int] = []
    start = end = 0
    for n in reversed(numels):
        if end > start and elem * (end + n - start) > cap:
            buckets.append(end - start)
            start = end
        end += n
    return [*buckets, max(end, padded) - start]


def sharded_buckets(numels: list[int], workload: Workload, k: int) -> list[list[int]]:
    """ZeroDataParallel's buckets of one chunk's flat buffer (`numels` in registration
    order), padded to k ceil(n / k) and sharded k ways: per bucket, in the buffer's order,
    its elements in each rank's shard (the pieces its reduce-scatter gives each rank)."""
    shard = -(-sum(numels) // k)
    out, start = [], 0
    for size in flat_bucket_sizes(numels, workload, k * shard):
        end = start + size
        out.append([max(0, min(end, (r + 1) * shard) - max(start, r * shard)) for r in range(k)])
        start = end
    return out


def gradient_buckets(model: ModelSpec, workload: Workload, layout: Layout, at: Coords) -> list[int]:
    """Without ZeRO: the elements of each bucket the rank all-reduces per step, over its
    chunks (DataParallel in float32, a stage-0 flat buffer in mixed precision)."""
    chunks = chunk_tensors(model, layout, at.stage)
    whole = workload.precision.param_bytes == 4
    return [
        n
        for c in chunks
        for n in (ddp_bucket_sizes(c, workload) if whole else flat_bucket_sizes(c, workload))
    ]
