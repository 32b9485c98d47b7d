"""FLOPs one rank executes in a step, as `FlopCounterMode` counts them (simulate/).

The model's count (time.py `model_training_flops`) follows Narayanan et al.: attention's
backward costs twice its forward, 12 L s h per token in all. The fused attention kernels
our models call (scaled_dot_product_attention: flash on CUDA and on the CPU) recompute
q k^T in the backward instead of saving the s x s scores, so the backward runs five
products, not four: 2.5 times the forward, 2 L s h more per token (torch's
`sdpa_backward_flop_count`; the ring's blocks do the same, context_cost.BACKWARD_BLOCK).
Found by `paratrain simulate`: every other matmul agreed exactly. The model's count stays
the convention for MFU (the published runs count 12 L s h); this is the executed one.

Recomputation as it runs. Selective keeps every matmul's and the fused attention's
output, so no product runs twice: the same FLOPs as none. Full runs each block's forward
again in backward, save its last product: non-reentrant checkpointing stops once the
MLP's down projection has its input back (torch.utils.checkpoint's early stop), so it
adds the block's forward less 2 h f per token per layer. Llama's count (time.py) says so
already; GPT's is Narayanan et al.'s, one whole forward more (24 h^2 + 4 s h per token
per layer), which the simulation measured as 16 h^2 + 4 s h.

Under a pipeline a rank executes its stage's layers for the whole step's micro-batches,
and the last stage the head as well: per stage, its layers' count (virtual stages
included) and, on the last, the head's, over its tokens (the batch's share of its dp
rank) and split by tp.

Under context parallelism the ring's attention is not SDPA's: it computes (chunk x
chunk) blocks of matmuls with a logsumexp, 2 products forward and 5 backward per block
(context_cost.ring_flops: load-balanced causal chunks); full recomputation runs it
forward once more, and so does selective, which keeps no output of it
(context.ring_passes; found by `paratrain simulate --cp 2 --recompute selective`).
All-to-all attention is SDPA over the whole sequence for a cp-th of the heads, counted
per token as without cp. Everything else splits over the cp
ranks by tokens.

Predicted for a model given by its shape, without experts (the router decides the
work) and without LoRA (its frozen weights skip their gradients' products, its adapters
add theirs: not counted yet). Otherwise None.
"""

from __future__ import annotations

from dataclasses import replace

from paratrain.models.presets import ffn_width
from paratrain.plan.context import ring_passes
from paratrain.plan.context_cost import ring_flops
from paratrain.plan.layout import Layout, Workload
from paratrain.plan.model import ModelSpec
from paratrain.plan.pipeline import recomputed_layers, stage_virtual_stages, virtual_stage_layers
from paratrain.plan.time import (
    counted_by_shape,
    gpt_layer_flops_per_token,
    head_flops_per_token,
    llama_flops_per_token,
)


def sdpa_flops_per_token(model: ModelSpec, recompute: str, fused: bool = True) -> int:
    """One layer's attention through SDPA per token: 4 s h forward, 10 s h backward (the
    fused kernel's five products), 4 s h more under full recomputation. Unfused (SDPA's
    math path, which its CPU kernels take under dropout): four products backward, 8 s h,
    and its batched products are no output selective recomputation keeps, so the
    forward runs again under either recomputation."""
    if fused:
        return (18 if recompute == "full" else 14) * model.shape.seq_len * model.shape.d_model
    return (12 if recompute == "none" else 16) * model.shape.seq_len * model.shape.d_model


def layer_flops_per_token(
    model: ModelSpec, recompute: str, dropout: float = 0.0, fused: bool = True
) -> float:
    """One layer's executed FLOPs per token (a model with a shape, no experts): the
    whole model's less the head's, per layer. With dropout after the MLP, full
    recomputation has to run its down projection again (the dropout's input): no early
    stop."""
    shape = model.shape
    again = 2 * shape.seq_len * shape.d_model if fused else 0  # the backward's q k^T again
    if counted_by_shape(model):
        full = recompute == "full"
        layer = gpt_layer_flops_per_token(model, "full" if full else "none")
        return layer - (2 * shape.d_model * ffn_width(shape) if full and not dropout else 0) + again
    whole = llama_flops_per_token(model, recompute) - head_flops_per_token(model)
    return whole / shape.n_layer + again


def attention_flops(
    model: ModelSpec,
    workload: Workload,
    layout: Layout,
    cp_rank: int,
    tokens: float,
    fused: bool = True,
) -> float:
    """One layer's attention on a rank in a step: `tokens` its tokens, its share of the
    heads (module docstring)."""
    shape = model.shape
    # All-to-all attention is SDPA over the whole sequence for a cp-th of the heads: per
    # token of the rank, as without cp (context_parallel/ulysses.py)
    if layout.cp == 1 or layout.cp_method == "alltoall":
        return sdpa_flops_per_token(model, workload.recompute, fused) * tokens / layout.tp
    # the ring's attention is no output selective recomputation keeps: it runs again
    forwards, _ = ring_passes(workload.recompute)
    b, heads, d = workload.micro_batch, shape.n_head // layout.tp, shape.d_model // shape.n_head
    fwd, bwd = (ring_flops(b, heads, shape.seq_len, d, layout.cp, cp_rank, True, True, bw)
                for bw in (False, True))  # fmt: skip
    micro_batches = tokens / (b * shape.seq_len / layout.cp)
    return micro_batches * (forwards * fwd + bwd)


def stage_flops(
    model: ModelSpec,
    workload: Workload,
    layout: Layout,
    stage: int,
    cp_rank: int,
    dropout: float = 0.0,
    device: str = "cuda",
) -> float:
    """What a rank of pipeline `stage` (cp coordinate `cp_rank`) executes in a step: its
    layers, and the head on the stage that holds the last virtual stage."""
    s, c = layout.pp, layout.chunks
    layers = virtual_stage_layers(model.shape.n_layer, s, c)
    mine = stage_virtual_stages(stage, s, c)
    tokens = workload.global_batch * model.shape.seq_len / layout.data_ranks  # type: ignore[operator]
    fused = not (dropout and device == "cpu")  # SDPA's CPU kernels have no dropout

    def layer(w: Workload) -> float:
        counted = "full" if w.recompute == "full" else "none"  # the attention layer_flops has
        dense = layer_flops_per_token(model, w.recompute, dropout, fused)
        dense -= sdpa_flops_per_token(model, counted, fused)
        return dense * tokens / layout.tp + attention_flops(
            model, w, layout, cp_rank, tokens, fused
        )

    plain = layer(replace(workload, recompute="none"))
    again = layer(workload) - plain  # what recomputation adds, per time it runs
    recomputed = recomputed_layers(model.shape.n_layer, stage, s, c, layout.schedule)
    head = head_flops_per_token(model) * tokens / layout.tp if s * c - 1 in mine else 0
    return sum(layers[vs] for vs in mine) * plain + recomputed * again + head


def rank_step_flops(
    model: ModelSpec,
    workload: Workload,
    layout: Layout,
    stage: int = 0,
    cp_rank: int = 0,
    dropout: float = 0.0,
    device: str = "cuda",
) -> int | None:
    """The matmul FLOPs in one step (forward, backward) of a rank on `stage` at cp
    coordinate `cp_rank`, or None where not predicted (module docstring). `dropout` and
    `device`: the model's dropout and where it runs (SDPA's kernels there)."""
    shaped = counted_by_shape(model) or (model.arch == "llama" and model.has_shape)
    if not shaped or model.num_experts or workload.global_batch is None or workload.lora:
        return None
    return round(stage_flops(model, workload, layout, stage, cp_rank, dropout, device))
