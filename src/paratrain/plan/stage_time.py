"""Busy seconds of the busiest GPU in a step: matmuls at the calibrated efficiency,
pointwise ops at memory bandwidth (the roofline model, Williams et al., CACM 52(4), 2009).

Matmuls are timed as FLOPs / (peak x utilisation), `utilisation` being the one efficiency
each cluster preset calibrates (plan/cluster.py). The ops between them (LayerNorm, GELU,
softmax, dropout, residual adds) do about one FLOP per byte they move, so their time is
bytes / HBM bandwidth, a datasheet figure, not a fitted one. Their share shrinks as 1/h:
a third of a 1.7B model's step on an A100, a twentieth of a 1T model's
(docs/planner.md, "Against published runs").

A GPT given by its shape is counted stage by stage, because a pipeline runs at the pace of
its slowest stage: the stage with the most layers, plus the head on the last one. Any
other model spreads the step's FLOPs evenly over the GPUs, with no memory-bound term.
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.plan import time as ptime
from paratrain.plan.cluster import ClusterSpec
from paratrain.plan.layout import Layout, Workload
from paratrain.plan.model import ModelSpec
from paratrain.plan.pipeline import stage_virtual_stages, virtual_stage_layers

MASK_BYTES = 1  # a dropout mask element (torch.bool)


@dataclass(frozen=True)
class Busy:
    matmul_s: float
    memory_s: float

    @property
    def total_s(self) -> float:
        return self.matmul_s + self.memory_s


def pointwise_bytes_per_token(model: ModelSpec, workload: Workload, tp: int) -> float:
    """HBM bytes one tp rank's pointwise ops move per layer and token, all passes.

    Forward, with 16-bit activations (2 bytes) and each op reading its inputs and writing
    its output once:
    - two LayerNorms, read h and write h: 8h; two bias-dropout-residual adds, read the
      input and the residual, write the sum and a 1-byte mask: 14h. Not split by tensor
      parallelism (without sequence parallelism every tp rank runs them whole): 22h.
    - bias and GELU on the 4h MLP activation, read and write: 16h / t.
    - "scores" (unfused) attention, Megatron-LM's in 2021, writes a s scores per token;
      scale-mask-softmax reads and writes them, dropout reads them and writes them with a
      mask, the product with v reads them: (2 + 4 + 5 + 2) a s = 13 a s / t. "fused"
      attention (our runtime's SDPA) keeps them on chip.
    Backward moves about twice the forward's bytes (reads the saved input and the incoming
    gradient, writes the outgoing one); recomputation, full or our selective (which
    repeats exactly these pointwise ops), repeats the forward: 3 or 4 forward passes' worth.
    """
    h, a, s, t = model.d_model, model.n_head, model.seq_len, tp
    assert h and a and s, "pointwise bytes need the shape"
    act = workload.precision.activation_bytes
    norms_and_adds = 4 * act + 2 * (3 * act + MASK_BYTES)  # 22 with 2-byte activations
    forward = norms_and_adds * h + 8 * act * h / t
    if workload.attention == "scores":
        forward += (6 * act + MASK_BYTES) * a * s / t
    passes = 3 if workload.recompute == "none" else 4
    return passes * forward


def busy_time(
    model: ModelSpec,
    workload: Workload,
    layout: Layout,
    cluster: ClusterSpec,
    microbatches: int,
    step_flops: float,
) -> Busy:
    """The busiest GPU's matmul and memory-bound seconds for one step of K micro-batches."""
    if not ptime.counted_by_shape(model):
        return Busy(step_flops / (layout.world * cluster.effective_flops), 0.0)
    s, v, t = layout.pp, layout.chunks, layout.tp
    # a cp rank runs s / cp of the tokens (and, load-balanced, its share of attention)
    tokens = microbatches * workload.micro_batch * model.shape.seq_len / layout.cp
    layer = ptime.gpt_layer_flops_per_token(model, workload.recompute)
    head = ptime.head_flops_per_token(model)
    pointwise = pointwise_bytes_per_token(model, workload, t) if cluster.memory_bw else 0.0
    pieces = virtual_stage_layers(model.shape.n_layer, s, v)
    last = s * v - 1
    slowest = Busy(0.0, 0.0)
    for stage in range(s):
        mine = stage_virtual_stages(stage, s, v)
        layers = sum(pieces[vs] for vs in mine)
        flops = tokens * (layers * layer + (head if last in mine else 0.0)) / t
        memory_s = tokens * layers * pointwise / cluster.memory_bw if pointwise else 0.0
        busy = Busy(flops / cluster.effective_flops, memory_s)
        if busy.total_s > slowest.total_s:
            slowest = busy
    return slowest


def backward_share(recompute: str) -> float:
    """The backward's part of one micro-batch's work: 2 of 3 forward passes' worth, 3 of 4
    with recomputation (which runs inside the backward)."""
    return 0.75 if recompute == "full" else 2 / 3
