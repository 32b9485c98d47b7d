"""What ZB-H1 keeps from a micro-batch's input pass (BI) to its weight pass (BW).

Our split backward (parallel/pipeline/split_backward.py) asks autograd, in BI, for the
gradient dY arriving at every weight consumer (each matmul and norm that takes a weight),
and seeds BW with them. Per token of a block, in the activations' precision, t = tp, with
d_kv the key/value width and f the MLP's:

  q, k, v Linears (column-parallel): their outputs' gradients   (h + 2 d_kv) / t
  attention's output projection (row-parallel): the residual's  h
  the MLP's inner Linears (fc; gate and up): their outputs'     f / t; 2 f / t
  the MLP's output projection (row-parallel): the residual's    h
  the two norms: their outputs' gradients                       2h

On the CPU a Llama's rms_norm is composite and its weight's consumer is a multiply in
fp32 (plan/llama_activations.py), so its norms' gradients are fp32 there, 4 bytes an
element whatever the precision (measured in bf16: ten fp32 (b, s, h) at the peak of a
2-layer last stage, five norms times two micro-batches). GPT's k and v are h wide (d_kv
= h) and its MLP has one inner Linear. The stage holding the head adds the final norm's
(h) and the head's, the logits' gradient (V / t). A stage whose input is the token ids
keeps none: its BI has nothing to compute and BW is a whole backward. Stage s defers up
to s weight passes (parallel/pipeline/schedules.py `zb_h1`), so as the BI of the next
micro-batch ends, min(s + 1, K) sets are alive. The MLP's gradients that a plain
backward holds beside its activations (rank_peak.py backward_working_bytes) are among
them (fc's, gate's and up's): rank_peak takes the larger of the two, not their sum.

As BW ends (where ZeRO's reductions leave it, rank_peak.py), BW has freed what each
consumer saved, its input X (its calls run with retain_graph=False), but not what the
input path saved for BI alone, which stays until the micro-batch's graph goes, after
BW (weight_pass_bytes).
"""

from __future__ import annotations

from paratrain.models.presets import ffn_width, kv_heads
from paratrain.plan.layout import Layout, Workload
from paratrain.plan.model import ModelSpec
from paratrain.plan.pipeline import stage_layers


def norm_gradient_element_bytes(model: ModelSpec, workload: Workload, device: str) -> int:
    """A norm's output gradient's element size (module docstring)."""
    cpu_composite = model.arch == "llama" and device == "cpu"
    return 4 if cpu_composite else workload.precision.activation_bytes


def consumer_gradient_bytes(model: ModelSpec, workload: Workload, tp: int, device: str) -> float:
    """One micro-batch's dY of every weight consumer of one block (module docstring)."""
    m = model.shape
    h, f = m.d_model, ffn_width(m)
    d_kv = kv_heads(m) * (h // m.n_head)
    inner = 2 * f if model.arch == "llama" else f
    e = workload.precision.activation_bytes
    norm = norm_gradient_element_bytes(model, workload, device)
    per_token = e * ((h + 2 * d_kv + inner) / tp + 2 * h) + norm * 2 * h
    return workload.micro_batch * m.seq_len * per_token


def input_passes_alive(layout: Layout, microbatches: int, stage: int) -> int:
    """Micro-batches of stage `stage` whose input pass has run and whose weight pass has
    not, as an input pass ends: min(s + 1, K) under ZB-H1 (module docstring); none on the
    first stage (it has no input pass) or under another schedule."""
    if layout.schedule != "zb-h1" or stage == 0:
        return 0
    return min(stage + 1, microbatches)


def deferred_gradient_bytes(
    model: ModelSpec,
    workload: Workload,
    layout: Layout,
    microbatches: int,
    stage: int,
    device: str,
) -> float:
    """The dYs stage `stage` of a ZB-H1 pipeline holds as an input pass ends: min(s + 1, K)
    micro-batches' (module docstring); 0 for other schedules and for the first stage."""
    sets = input_passes_alive(layout, microbatches, stage)
    if not sets:
        return 0.0
    m, t = model.shape, layout.tp
    layers = stage_layers(m.n_layer, stage, layout.pp, layout.chunks)
    one = layers * consumer_gradient_bytes(model, workload, t, device)
    if stage == layout.pp - 1:  # the final norm's and the head's
        e, norm = (
            workload.precision.activation_bytes,
            norm_gradient_element_bytes(model, workload, device),
        )
        one += workload.micro_batch * m.seq_len * (norm * m.d_model + e * m.vocab_size / t)
    return sets * one


def weight_pass_bytes(
    model: ModelSpec,
    workload: Workload,
    layout: Layout,
    microbatches: int,
    stage: int,
    device: str,
    waiting: bool,
) -> float:
    """ZB-H1: what stage `stage` holds of micro-batch m's backward as m's weight pass ends,
    besides the graphs that wait for theirs (rank_peak counts their activations), and with
    `waiting` their dYs too. Of m, the tensors only the input path saved, per token
    (t = tp): GPT's SDPA q, k, v and output and gelu's input, e 8h / t; Llama's SDPA
    tensors, and g, u and silu(g) of its MLP, e (4h + 3f) / t, with the rotary tables; the
    logsumexp, 4a / t; and the dY of BW's last call (the head's on the last stage, else the
    MLP's output projection). The consumers' inputs are gone (module docstring).
    zb-h1 zero2 pp 2 with 8 KiB buckets, the last stage: +20.8% without this, +1.5% with
    it and the logits counted once (docs/planner.md). Without recomputation only: with
    it, BI recomputes each block (not counted yet); the CPU's composite rms_norm keeps an
    fp32 input more (neither)."""
    if layout.schedule != "zb-h1" or stage == 0 or workload.recompute != "none":
        return 0.0
    m, t, b = model.shape, layout.tp, workload.micro_batch
    h, a, e = m.d_model, m.n_head, workload.precision.activation_bytes
    if model.arch == "llama":
        path = e * (4 * h + 3 * ffn_width(m)) / t
        tables = 2 * e * m.seq_len * (h // a)  # cos and sin, per sequence
    else:
        path, tables = e * 8 * h / t, 0
    layers = stage_layers(m.n_layer, stage, layout.pp, layout.chunks)
    kept = layers * (b * m.seq_len * (path + 4 * a / t) + b * tables)
    last = b * m.seq_len * e * (m.vocab_size / t if stage == layout.pp - 1 else h)
    sets = input_passes_alive(layout, microbatches, stage)
    others = deferred_gradient_bytes(model, workload, layout, microbatches, stage, device)
    return (kept + last) / layout.cp + (others * (sets - 1) / sets if waiting else 0.0)
