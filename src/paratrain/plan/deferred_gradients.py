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
    if layout.schedule != "zb-h1" or stage == 0:
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
    return min(stage + 1, microbatches) * one
