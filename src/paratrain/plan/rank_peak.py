"""A rank's peak memory: its model state alive then, its stage's activations as our
runtime saves them on the run's device, and what is held beside them at the peak: on the
last stage what the loss holds, on every stage the block that recomputation rebuilds in
backward, and on a pipeline stage the output each graph in flight keeps for its backward
(plan/activations.py). `paratrain simulate` holds it within 5% of the measured peak
(docs/planner.md). Or the peak is the optimizer's update (update_peak_bytes). Not counted
yet: ZeRO's gathered units and buffers and what its update holds beyond DataParallel's,
a backward's own gradients outside recomputation, ZB-H1's input gradients kept for its
weight pass, a bf16 Llama chunk's received input on the CPU (its composite norm keeps an
fp32 copy instead).
"""

from __future__ import annotations

import dataclasses

from paratrain.plan import activations
from paratrain.plan.activations import in_flight_chunks
from paratrain.plan.layout import Layout, Workload, flat_buffered
from paratrain.plan.model import ModelSpec


def state_at_peak(
    workload: Workload,
    layout: Layout,
    state: dict[str, int],
    first_step: bool,
    microbatches: int,
    stage: int,
) -> int:
    """The model state (a rank's params, grads, optimizer, master and total) alive at the
    step's peak, at the loss or in backward: the optimizer's state is made by the first
    step's update, after that step's backward; and DataParallel without flat buffers over
    a group of one keeps no gradient buckets and drops its gradients before each forward
    (data_parallel/wrapper.py `zero_grad`), so they are gone where the peak comes before
    any backward: every forward of the step runs first (one micro-batch, or GPipe)."""
    alive = state["total"] - (state["optimizer"] if first_step else 0)
    alone = not flat_buffered(workload, layout) and layout.dp * layout.cp == 1
    every_forward_first = in_flight_chunks(layout, microbatches, stage) == (
        microbatches * layout.chunks
    )
    return alive - (state["grads"] if alone and every_forward_first else 0)


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


def recompute_transient_bytes(model: ModelSpec, workload: Workload, tp: int, device: str) -> float:
    """What recomputation rebuilds in backward, one block at a time: the block's
    activations as it runs without recomputation, less what recomputation keeps; and
    beside them the gradient that reached the block's output and the one it is making
    for its input, two (b, s, h) in the activations' precision (llama3-70b over pp 8
    with full recomputation: 5.0% under the measured peak without them, 3.6% with)."""
    if workload.recompute == "none":
        return 0.0
    whole = dataclasses.replace(workload, recompute="none")
    rebuilt = activations.block_activation_bytes(model, whole, tp, "fused", device)
    kept = activations.block_activation_bytes(model, workload, tp, "fused", device)
    s, h = model.shape.seq_len, model.shape.d_model
    gradients = 2 * workload.micro_batch * s * h * workload.precision.activation_bytes
    return rebuilt - kept + gradients


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
    activations in flight: the chunk outputs they keep (held_outputs), and the larger of
    the loss's transient (last stage; it is gone before backward reaches the blocks) and
    the block being recomputed; cp splits the tokens of all of it."""
    acts = activations.stage_activation_bytes(
        model, workload, layout, microbatches, stage, "fused", device
    )
    if acts is None:
        return None
    outputs = held_outputs(layout, microbatches, stage) * message_bytes(model, workload, layout)
    transient = recompute_transient_bytes(model, workload, layout.tp, device) / layout.cp
    if stage == layout.pp - 1:
        loss = activations.loss_transient_bytes(model, workload, layout.tp) / layout.cp
        transient = max(transient, loss)
    return state + acts + outputs + transient, acts


def update_peak_bytes(workload: Workload, state: dict[str, int], device: str) -> float | None:
    """The peak of AdamW's update: the whole state (params, grads, moments, master), and
    beside it on the CPU foreach's denominator sqrt(v) (CUDA's fused kernel makes none)
    and, with master weights, the fp32 copy of the gradients they are updated from, four
    bytes per updated element each. A rank whose activations are small next to its
    state peaks here (llama3-405b's long-context last stage, docs/planner.md). Measured
    for DataParallel; ZeRO's update holds more (its shards' buffers), not counted; None
    for other optimizers."""
    if workload.optimizer != "adam" or workload.muon_ns_bytes:
        return None
    updated = state["optimizer"] / 8  # AdamW's two fp32 moments per element
    copies = (device == "cpu") + (state["master"] > 0)
    return state["total"] + 4 * updated * copies
