"""A rank's peak memory: its model state alive then, its stage's activations as our runtime
saves them on the run's device, and what is held beside them at the peak: on the last
stage what the loss holds, or the head's backward after it (plan/head_memory.py); in
backward the MLP's gradients, the block that recomputation rebuilds, ZB-H1's kept
gradients (plan/deferred_gradients.py), ZeRO-2's bucket and ZeRO-3's whole units
(plan/zero3_peak.py); and on a pipeline stage the output each graph in flight keeps for
its backward and GPipe's posted receives (plan/activations.py). Or the peak is where
ZeRO's reductions leave backward, the activations gone (under ZB-H1 a weight pass, whose
graph is not: deferred_gradients.weight_pass_bytes), a compressed bucket's reduction
(plan/rank_compress.py), the optimizer's update (update_peak_bytes) or DiLoCo's outer
step (plan/rank_diloco.py). `paratrain simulate` holds it within 5% of the measured peak
(docs/planner.md). The state alive then: plan/peak_state.py. Not counted yet: ZB-H1 with
selective recomputation, whose input pass keeps its recomputed tensors until the weight
pass; a bf16 Llama chunk's received input on the CPU (its composite norm keeps an fp32
copy instead)."""

from __future__ import annotations

import dataclasses

from paratrain.models.presets import ffn_width
from paratrain.plan import activations
from paratrain.plan.activations import in_flight_chunks
from paratrain.plan.deferred_gradients import deferred_gradient_bytes, weight_pass_bytes
from paratrain.plan.grad_buckets import sharded_buckets, trained_chunk_tensors
from paratrain.plan.head_memory import head_backward_bytes, logits_bytes, zb_h1_logits_bytes
from paratrain.plan.layout import Layout, Workload
from paratrain.plan.memory import ModelState
from paratrain.plan.model import ModelSpec
from paratrain.plan.rank_compress import compress_reduce_bytes, first_compressed_bucket_bytes
from paratrain.plan.zero3_peak import (
    REDUCE_BYTES,
    zero3_backward_bytes,
    zero3_backward_end_bytes,
    zero3_block_bytes,
)


def message_bytes(model: ModelSpec, workload: Workload, layout: Layout) -> float:
    """One pipeline message, (b, s / cp, h) in the activations' precision: what a chunk
    outputs and receives (parallel/pipeline/runtime.py `_shape`)."""
    s, h = model.shape.seq_len, model.shape.d_model
    return workload.micro_batch * s / layout.cp * h * workload.precision.activation_bytes


def held_outputs(layout: Layout, microbatches: int, stage: int) -> int:
    """Chunk outputs a stage holds at its peak: each graph in flight keeps its output for
    its backward (runtime.py `_backward` runs autograd from it; the send of it is let go
    once a later receive shows it complete, pipeline/step_state.py), except a graph
    of the last virtual stage, whose output is the loss. The last stage's graphs in flight
    are all of its last chunk with one chunk; interleaved, one (its first forward of the
    last chunk comes after the warm-up's forwards of the others)."""
    if layout.pp == 1:
        return 0
    graphs = in_flight_chunks(layout, microbatches, stage)
    if stage < layout.pp - 1:
        return graphs
    return 0 if layout.chunks == 1 else graphs - 1


def posted_receives(layout: Layout, microbatches: int, stage: int) -> int:
    """Receive buffers a stage has posted and not yet read at its first backward: the
    runtime posts each receive as early as its order of calls allows, so that gloo moves
    the message during compute (pipeline/batches.py `plan_calls`). Under GPipe a stage
    before the last has done every forward by then, and has posted all K gradient
    receives: K - 1 wait beside the one being read (gpt-tiny over pp 2 with full
    recomputation, stage 0: 15 buffers, +20.8% without them). Other schedules hold one
    or two, within the 5% they are held to, and are not counted."""
    if layout.schedule != "gpipe" or stage == layout.pp - 1:
        return 0
    return microbatches - 1


def rebuilt_block_bytes(model: ModelSpec, workload: Workload, layout: Layout, device: str) -> float:
    """What recomputation rebuilds in backward, one block at a time: the block's
    activations as it runs without recomputation, less what recomputation keeps (0
    without recomputation)."""
    if workload.recompute == "none":
        return 0.0
    t, sp = layout.tp, layout.sequence_parallel
    whole = dataclasses.replace(workload, recompute="none")
    rebuilt = activations.block_activation_bytes(model, whole, t, "fused", device, sp)
    kept = activations.block_activation_bytes(model, workload, t, "fused", device, sp)
    return rebuilt - kept


def block_gradient_bytes(model: ModelSpec, workload: Workload, layout: Layout) -> float:
    """The gradients a block's backward holds beside its activations. Without
    recomputation the MLP's (backward_working_bytes). With it, the gradient that reached
    the block's output, (b, s / r, h), r = tp under sequence parallelism, and beside it
    the larger of the one it makes for its input (the same size) and the MLP's
    (llama3-70b over pp 8 with full recomputation: 5.0% under the measured peak without
    the two residual gradients, 3.6% with; llama-tiny over pp 2, stage 0: +7.5% with them
    but without the MLP's, -1.7% with the larger)."""
    working = backward_working_bytes(model, workload, layout.tp)
    if workload.recompute == "none":
        return working
    s, h, t = model.shape.seq_len, model.shape.d_model, layout.tp
    tokens = workload.micro_batch * s / (t if layout.sequence_parallel else 1)
    residual = tokens * h * workload.precision.activation_bytes
    return residual + max(residual, working)


def zero2_bucket_bytes(model: ModelSpec, workload: Workload, layout: Layout, stage: int) -> int:
    """ZeRO-2 reducing every micro-batch (accumulate "shard"): a bucket of whole gradients
    is made at its first gradient in backward (data_parallel/zero.py `_on_grad_ready`),
    the first while nearly all activations are still there: the largest first bucket
    among the stage's chunks, in the gradients' dtype. With one bucket (the default 25 MB
    over a small model) that is the whole gradient: gpt-tiny over dp 4, 33.2% under the
    measured peak without it. Later buckets, whose reductions the fake group (and gloo
    at these sizes) has not finished when the next poll looks, gather until the
    backward's end (zero_launch_bytes)."""
    if layout.zero != 2 or workload.zero2_accumulate != "shard":
        return 0
    k = layout.shard_ranks
    firsts = [
        sum(sharded_buckets(c, workload, k)[0])
        for c in trained_chunk_tensors(model, workload, layout, stage)
    ]
    return max(firsts) * workload.precision.grad_bytes


def zero_launch_bytes(model: ModelSpec, workload: Workload, layout: Layout, stage: int) -> int:
    """ZeRO-1/2 as backward launches its last bucket's reduction, the activations gone:
    every bucket of the chunk still in flight (the fake group, like gloo at these sizes,
    finishes none before the backward's end waits for them all, zero.py `_flush`), each
    holding its fp32 send (ZeRO-2's bucket itself, or its copy where the gradients are
    narrower; ZeRO-1 sends a view of its held buffer unless it must copy) and the
    reduction's scratch, which the work keeps until it is waited for (comm/padded.py
    `start_reduce_scatter`, comm/ordering.py `KeptWork`); beside them the last bucket in
    the gradients' dtype, being copied. bf16 gpt-tiny, dp 4, 0.25 MiB buckets: +63%
    with the last bucket alone counted."""
    bucket = layout.zero == 2 and workload.zero2_accumulate == "shard"
    compressed = workload.compress != "none" and not workload.compress_idle
    if not (bucket or layout.zero == 1) or (compressed and layout.replicas == 1):
        return 0  # a compressed bucket is reduced at its launch (compress_reduce_bytes)
    k, grad = layout.shard_ranks, workload.precision.grad_bytes
    narrow, most = grad != REDUCE_BYTES, 0
    for tensors in trained_chunk_tensors(model, workload, layout, stage):
        buckets = sharded_buckets(tensors, workload, k)
        sends = sum(sum(p) * (bucket or narrow) + reduce_scratch(p) for p in buckets)
        most = max(most, sends * REDUCE_BYTES + sum(buckets[-1]) * grad * (bucket and narrow))
    return most


def reduce_scratch(pieces: list[int]) -> int:
    """The elements a reduce-scatter of `pieces` holds while in flight (comm/padded.py
    `start_reduce_scatter`): a copy of every piece where they go to their owners; else
    this rank's result, padded to the longest, and the input padded to k longest pieces
    unless they are already equal."""
    if max(pieces) - min(pieces) > 1:
        return sum(pieces)
    longest = max(pieces)
    return longest + (longest * len(pieces) if len(set(pieces)) > 1 else 0)


def backward_working_bytes(model: ModelSpec, workload: Workload, tp: int) -> float:
    """A block's backward at its MLP, beside the activations: the hidden layer's gradient
    and what the activation's backward makes from it, (b, s, f / t) each in the
    activations' precision: two for GPT's GELU (dH, the pre-activation's), three for
    Llama's SwiGLU (dH, the gate's, the up projection's). llama-tiny over pp 2, 1F1B:
    stage 0 5.7% under the measured peak without them. With recomputation, the larger of
    them and the input's gradient (block_gradient_bytes)."""
    shape = model.shape
    f, made = (4 * shape.d_model, 2) if shape.arch == "gpt" else (ffn_width(shape), 3)
    tokens = workload.micro_batch * shape.seq_len
    return made * tokens * f / tp * workload.precision.activation_bytes


def rank_peak_bytes(
    model: ModelSpec,
    workload: Workload,
    layout: Layout,
    microbatches: int,
    stage: int,
    state: int,
    device: str,
) -> tuple[float, float] | None:
    """(peak, activations) of a rank of pipeline stage `stage` whose state alive at the
    peak is `state` (state_at_peak); None when the model has no shape. Beside the
    activations in flight and the messages they keep (held_outputs, posted_receives):
    on the last stage at the loss its transient; or in a block's backward, the head's
    logits let go, its gradients, the block being rebuilt (cp splits the tokens of
    either), ZeRO-2's bucket and ZeRO-3's whole units. Or the peak comes later, where
    ZeRO's or the compressed reductions leave backward, the activations gone."""
    acts = activations.stage_activation_bytes(
        model, workload, layout, microbatches, stage, "fused", device
    )
    if acts is None:
        return None
    messages = held_outputs(layout, microbatches, stage) + posted_receives(
        layout, microbatches, stage
    )
    outputs = messages * message_bytes(model, workload, layout)
    # The rebuilt block sits beside its backward's gradients or, in ZB-H1's weight pass,
    # beside the gradients kept for it, which include the MLP's
    kept = deferred_gradient_bytes(model, workload, layout, microbatches, stage, device)
    gradients = max(block_gradient_bytes(model, workload, layout), kept)
    transient = (rebuilt_block_bytes(model, workload, layout, device) + gradients) / layout.cp
    transient += zero2_bucket_bytes(model, workload, layout, stage)
    transient += zero3_backward_bytes(model, workload, layout, stage)
    transient += first_compressed_bucket_bytes(model, workload, layout, stage)
    at_loss, at_head, head = 0.0, 0.0, 0.0
    if stage == layout.pp - 1:
        at_loss = acts + outputs
        at_loss += activations.loss_transient_bytes(model, workload, layout.tp) / layout.cp
        # then the head's backward, the loss's saved logits gone
        at_head = acts + outputs - logits_bytes(model, workload, layout) / layout.cp
        at_head += head_backward_bytes(model, workload, layout)
        # The head's backward ran before the blocks' and let go of its micro-batch's
        # logits, unless ZB-H1 keeps the graph for its W or the interleaved schedule ran a
        # later micro-batch's last chunk in between (llama3-70b over pp 8: +9.3% if freed)
        if layout.chunks == 1 and layout.schedule != "zb-h1":
            head = activations.head_bytes(model, workload, layout, "fused", device) / layout.cp
    in_blocks = acts - head + outputs + transient
    # ZeRO-2 reduces at every backward's end, beside the other graphs in flight (pp 2,
    # 1F1B, stage 0: +17.1% with PowerSGD, +12.7% under ZB-H1 with 0.25 MiB buckets)
    graphs = in_flight_chunks(layout, microbatches, stage)
    each = layout.zero == 2 and workload.zero2_accumulate == "shard"
    waiting = acts - zb_h1_logits_bytes(model, workload, layout, stage) / layout.cp + outputs
    others = waiting * (graphs - 1) / graphs if each else 0.0
    # Under ZB-H1 the reductions leave the weight pass, which keeps some of its graph
    others += weight_pass_bytes(model, workload, layout, microbatches, stage, device, each)
    working = block_gradient_bytes(model, workload, layout)
    ends = (zero_launch_bytes(model, workload, layout, stage),
            zero3_backward_end_bytes(model, workload, layout, stage),
            zero3_block_bytes(model, workload, layout, stage, device, working),
            compress_reduce_bytes(model, workload, layout, stage))  # fmt: skip
    return state + max(in_blocks, at_loss, at_head, *(others + e for e in ends if e)), acts


def update_peak_bytes(
    workload: Workload, state: dict[str, int], device: str, outer: ModelState | None = None
) -> float | None:
    """The peak of AdamW's update: the whole state (params, grads, moments, master), and
    beside it on the CPU foreach's denominator sqrt(v) (CUDA's fused kernel makes none)
    and, with master weights, the fp32 copy of the gradients they are updated from, four
    bytes per updated element each. A rank whose activations are small next to its
    state peaks here (llama3-405b's long-context last stage, docs/planner.md). Measured
    for DataParallel; ZeRO's update holds more (its shards' buffers), not counted; None
    for other optimizers. `outer`: DiLoCo's outer-step copies within `state` (master and
    optimizer), which AdamW does not update."""
    if workload.optimizer != "adam" or workload.muon_ns_bytes:
        return None
    outer = outer or ModelState(0, 0, 0, 0)
    updated = (state["optimizer"] - outer.optimizer) / 8  # AdamW's two fp32 moments an element
    copies = (device == "cpu") + (state["master"] > outer.master)
    return state["total"] + 4 * updated * copies
