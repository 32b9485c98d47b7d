"""ZeRO-3's terms of a rank's peak (plan/rank_peak.py): the units gathered whole, their
gradient buffers and the reductions in flight (parallel/data_parallel/fsdp.py), in
backward, as it reaches each block, and at its end."""

from __future__ import annotations

from paratrain.plan import activations
from paratrain.plan.layout import Layout, Workload
from paratrain.plan.model import ModelSpec
from paratrain.plan.pipeline import stage_layers, stage_virtual_stages
from paratrain.plan.rank_memory import exact, flat_buffers, tied_root

REDUCE_BYTES = 4  # gradients are reduced in fp32 (parallel/mixed_precision.py reduce_dtype)


def padded(n: int, k: int) -> int:
    """A flat buffer of n elements sharded k ways holds k ceil(n / k) (flat_buffer.py)."""
    return k * -(-n // k)


def zero3_backward_bytes(model: ModelSpec, workload: Workload, layout: Layout, stage: int) -> int:
    """ZeRO-3 in backward (data_parallel/fsdp.py): the unit computing and the `prefetch`
    units gathered ahead of it, whole, beside the root unit (a tied token table, whole
    from forward to its gradient), and the unit's gradient buffer, made whole at its
    first gradient; at the largest unit, in the parameters' dtype, each unit padded to
    k ceil(n / k). On the stage holding the head, its unit was reduced first, and its
    reduction's fp32 input and this rank's piece of the result stay beside them: the fake
    group, like gloo at these sizes, has not finished it when the next unit's poll
    looks (`_launch_ready`). llama-tiny over dp 4: 23.5% under the measured peak without
    any of it."""
    if layout.zero != 3 or not exact(model):
        return 0
    k = layout.shard_ranks
    chunks = flat_buffers(model, layout, stage)
    units = [padded(n, k) for chunk in chunks for n in chunk]
    root = tied_root(model, layout, stage)
    if root:
        units.remove(padded(root, k))
    largest = max(units, default=0)
    gathered = padded(root, k) + min(1 + workload.prefetch, len(units)) * largest
    pending = 0
    if layout.pp * layout.chunks - 1 in stage_virtual_stages(stage, layout.pp, layout.chunks):
        head = padded(chunks[-1][-1], k)  # the last chunk's last unit: the final norm and head
        pending = (head + head // k) * REDUCE_BYTES
    return (gathered + largest) * workload.precision.param_bytes + pending


def zero3_backward_end_bytes(
    model: ModelSpec, workload: Workload, layout: Layout, stage: int
) -> int:
    """ZeRO-3 as a backward ends, the activations gone: each unit's reduction still in
    flight, its fp32 input and this rank's piece of the result (the fake group, like gloo
    at these sizes, finishes none before the backward's end waits for them all, fsdp.py
    `_flush`), and beside them the gradient buffer of the unit that backward runs last,
    the first (the embeddings), whose gathered parameters went before its reduction was
    launched; with a tied table, the root unit, whole from forward to its gradient, and
    its gradient buffer. gpt-tiny in bf16 over dp 4 peaks here: 15% above the planner
    without it. The planner once counted three such units either way: 8.5% to 10.5% over
    at ZeRO-3 over 16 and 64 ranks without a root (docs/planner.md)."""
    if layout.zero != 3 or not exact(model):
        return 0
    k = layout.shard_ranks
    units = [padded(n, k) for chunk in flat_buffers(model, layout, stage) for n in chunk]
    in_flight = sum(n + n // k for n in units) * REDUCE_BYTES
    last = units[0]  # the first unit of the first chunk: the embeddings (or the root)
    whole = 2 if tied_root(model, layout, stage) else 1
    return in_flight + whole * last * workload.precision.param_bytes


def zero3_block_bytes(
    model: ModelSpec,
    workload: Workload,
    layout: Layout,
    stage: int,
    device: str,
    working: float,
) -> float:
    """ZeRO-3 as backward reaches the stage's j-th block, the largest over j: every later
    unit's reduction in flight (zero3_backward_end_bytes), block j whole with its
    gradient buffer and the unit before it gathered ahead (prefetch), a tied table whole
    with the gradient the head gave it, and the activations of blocks 1..j with the j-th
    backward's gradients beside them (`working`: rank_peak.block_gradient_bytes). In fp32
    a unit's gradient buffer is what its reduction sends, and these whole units outweigh
    the end's: zero3 tp 2 dp 64 +10.0% without it (with one unit at the end)."""
    if layout.zero != 3 or not exact(model):
        return 0.0
    k, p = layout.shard_ranks, workload.precision
    root = tied_root(model, layout, stage)
    first_vs = stage_virtual_stages(stage, layout.pp, layout.chunks)[0]
    embeddings = model.parts(layout.tp).first.total - root if first_vs == 0 else 0
    units = [padded(n, k) for chunk in flat_buffers(model, layout, stage) for n in chunk]
    ahead = [padded(n, k) for n in (root, embeddings) if n]
    blocks = stage_layers(model.shape.n_layer, stage, layout.pp, layout.chunks)
    t, sp = layout.tp, layout.sequence_parallel
    acts = activations.block_activation_bytes(model, workload, t, "fused", device, sp)
    table = padded(root, k) * (p.param_bytes + p.grad_bytes) if root else 0
    most = 0.0
    for j in range(1, min(blocks, len(units) - len(ahead)) + 1):
        at = len(ahead) + j - 1  # block j's unit
        in_flight = sum(n + n // k for n in units[at + 1 :]) * REDUCE_BYTES
        # gathered ahead of block j: block j - 1's unit, or the embeddings (the root is whole)
        before = units[at - 1] if at > (1 if root else 0) else 0
        whole = units[at] * (p.param_bytes + p.grad_bytes)
        whole += min(workload.prefetch, 1) * before * p.param_bytes + table
        most = max(most, in_flight + whole + (j * acts + working) / layout.cp)
    return most
