"""Seconds: communication by the alpha-beta model, FLOPs per step, the step.

- A message of n bytes on a link costs alpha + n / beta (Hockney 1994); a ring
  collective's per-rank cost is (its messages) alpha + (its bytes) / beta, e.g. ring
  all-reduce 2 (k - 1) alpha + 2 (k - 1) S / (k beta) (seeds, example 9.2.2: 24.5 GB at
  50 GB/s is 0.49 s, latency ignored).
- Training a dense transformer costs about 6 N FLOPs per token: 2 N forward, 4 N
  backward (Kaplan et al., arXiv:2001.08361, section 2.1); full recomputation reruns the
  forward, 8 N (arXiv:2104.04473, section 5.1). Seeds, example 9.2.2: 6 * 7e9 * 1024 *
  1024 tokens = 4.4e16 FLOPs, 440 s at 1e14 FLOP/s. A model given by its nominal N keeps
  that count, so the seeds' figures reproduce; a GPT given by its shape alone is counted
  as Narayanan et al. count it (`gpt_flops_per_token`, their eq. 3, with the attention
  scores and the head), a Llama as it runs (`llama_flops_per_token`). Selective
  recomputation (parallel/recompute.py) repeats no matrix multiply and no fused attention,
  only pointwise ops and norms: 6 N, as without recomputation (`training_flops`).
- A step is the busiest GPU's busy time (plan/stage_time.py: matmuls at the calibrated
  efficiency, pointwise ops at memory bandwidth), plus the pipeline bubble, plus the
  communication not hidden: tensor- and pipeline-parallel traffic sits on the critical
  path; a fraction `overlap` of data-parallel traffic may hide behind the backward pass
  still running when the gradients are ready, the last micro-batch's (`window_s`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from paratrain.models.presets import ffn_width, kv_heads
from paratrain.plan import moe
from paratrain.plan.cluster import ClusterSpec
from paratrain.plan.comm import GRADIENT_AXES, CommEntry
from paratrain.plan.model import ModelSpec


def message_time(nbytes: float, messages: int, bandwidth: float, latency_s: float) -> float:
    """alpha-beta: messages * alpha + bytes / beta (bandwidth in bytes/s)."""
    return messages * latency_s + nbytes / bandwidth


def entry_time(entry: CommEntry, cluster: ClusterSpec) -> float:
    if entry.link == "intra":
        return message_time(entry.bytes, entry.messages, cluster.intra_bw, cluster.intra_latency_s)
    return message_time(entry.bytes, entry.messages, cluster.inter_bw, cluster.inter_latency_s)


def training_flops(n_params: int, tokens: float, recompute: str = "none") -> float:
    """6 N T, or 8 N T when every layer's forward is recomputed.

    Selective recomputation counts 6 N T: it keeps every matmul's and the fused attention's
    output and repeats, per token and layer, only the pointwise ops and norms between
    them: for our GPT 7h + 4 output elements (two LayerNorms with their mean and rstd,
    gelu's 4h, one residual add; the block's last add is not repeated), for our Llama about
    20h at f = 2h, d_kv = h/2 (norms, rotary, the repeat of k and v, silu and its product,
    one add). At about 10 FLOPs an element that is about 70h against the GPT layer's
    72 h^2 matmul FLOPs per token: 1/h of the step, not counted. tests/test_recompute.py
    measures both: no extra matmul or attention FLOPs, and the GPT's 7h + 4.
    """
    return (8 if recompute == "full" else 6) * n_params * tokens


def llama_flops_per_token(model: ModelSpec, recompute: str = "none") -> float:
    """Training FLOPs per token of our Llama (models/llama.py), forward and backward.

    A matrix of n weights costs 2n FLOPs per token forward and 4n backward (input and
    weight gradients), Kaplan et al.'s 6N, here over the matrices only: per block q and o
    2h^2, k and v 2h d_kv, SwiGLU's gate, up and down 3hf (P), and the head Vh; the token
    table is a lookup and the RMSNorms are elementwise. Attention multiplies by the
    activations, not weights: q k^T and the scores times v cost 2 s h each forward per token
    per layer, for all a query heads (GQA repeats k and v, it does not skip heads), twice
    that backward: 12 L s h, the s / (6h) term of Narayanan et al.'s count (arXiv:2104.04473,
    96 B s L h^2 (1 + s / (6h) + V / (16 L h)) with recomputation: 16 L s h, 12 without),
    the full s x s block as they count it, causal mask or not. Full recomputation reruns
    each block's forward up to its last saved tensor: PyTorch's non-reentrant checkpoint
    stops once down's input is saved again, before down's product, so it adds
    L (2 (P - hf) + 4 s h). Selective recomputation adds no matmul (`training_flops`).
    tests/test_plan_llama.py counts the model's matmuls and finds exactly this.
    """
    h, s, n_layer = model.d_model, model.seq_len, model.n_layer
    assert h and s and n_layer and model.n_head and model.vocab_size, "FLOPs need the shape"
    f, d_kv = ffn_width(model.shape), kv_heads(model.shape) * (h // model.shape.n_head)
    block = 2 * h * h + 2 * h * d_kv + 3 * h * f  # P: the block's matrices
    per_token = 6 * (n_layer * block + model.vocab_size * h) + 12 * n_layer * s * h
    if recompute == "full":
        per_token += n_layer * (2 * (block - h * f) + 4 * s * h)
    return per_token


def counted_by_shape(model: ModelSpec) -> bool:
    """A GPT given by its shape alone (no nominal N): counted layer by layer, as it runs."""
    return model.arch == "gpt" and model.has_shape and model.n_params is None


def gpt_layer_flops_per_token(model: ModelSpec, recompute: str = "none") -> float:
    """One GPT layer's training FLOPs per token, as Narayanan et al. count them.

    Forward: 24 h^2 for the matrices (q, k, v and proj 8 h^2, the 4h MLP 16 h^2) and 4 s h
    for the scores and their product with v (the whole s x s block, causal or not);
    backward twice the forward: 72 h^2 (1 + s / (6h)). Full recomputation reruns the
    layer's forward once more, as Megatron-LM's checkpoint does: 96 h^2 (1 + s / (6h)).
    (PyTorch's non-reentrant checkpoint, which our runtime uses, stops before the MLP's
    last matmul, 8 h^2 fewer: `llama_flops_per_token` counts that for the Llama.)
    """
    h, s = model.d_model, model.seq_len
    assert h and s, "FLOPs need the shape"
    passes = 4 if recompute == "full" else 3
    return passes * (24 * h * h + 4 * s * h)


def head_flops_per_token(model: ModelSpec) -> float:
    """The output layer: 2 V h forward, twice that backward, never recomputed."""
    return 6 * model.shape.vocab_size * model.shape.d_model


def gpt_flops_per_token(model: ModelSpec, recompute: str = "none") -> float:
    """L layers and the head. With full recomputation, times B s, this is eq. 3 of
    Narayanan et al. (arXiv:2104.04473): 96 B s L h^2 (1 + s / (6h) + V / (16 L h)), the
    count behind their published TFLOP/s (4 forward passes' worth of the layers, 3 of the
    head); without it (and with selective recomputation) 72 B s L h^2 (1 + s / (6h) +
    V / (12 L h)). Embedding lookups, norms and pointwise ops are not counted as FLOPs:
    they are memory-bound (plan/stage_time.py)."""
    layer = gpt_layer_flops_per_token(model, recompute)
    return model.shape.n_layer * layer + head_flops_per_token(model)


def model_training_flops(
    model: ModelSpec, tokens: float, recompute: str = "none", imbalance: float = 1.0
) -> float:
    """The step's FLOPs: a Llama with a shape counted as it runs, a GPT given by its shape
    as Narayanan et al. count it, anything else (a nominal N) 6 N T. A mixture of experts
    is counted from its active parameters (plan/moe.py): the Llama count with a k f + f_s
    wide MLP, plus the router; with `imbalance` > 1, the busiest expert rank's share (its
    experts run that many times the mean load, up to the capacity factor)."""
    if model.num_experts:
        dense = moe.dense_equivalent(model, imbalance)
        per_token = llama_flops_per_token(dense, recompute) + moe.router_flops_per_token(model)
        return per_token * tokens
    if model.arch == "llama" and model.has_shape:
        return llama_flops_per_token(model, recompute) * tokens
    if counted_by_shape(model):
        return gpt_flops_per_token(model, recompute) * tokens
    return training_flops(model.params, tokens, recompute)


def compute_time(flops: float, gpus: int, cluster: ClusterSpec) -> float:
    """flops spread evenly over `gpus`, each at peak * utilisation."""
    return flops / (gpus * cluster.effective_flops)


@dataclass(frozen=True)
class StepTime:
    compute_s: float  # busy time of the busiest GPU: matmuls and memory-bound ops
    bubble_s: float
    exposed_comm_s: float
    comm_s: float  # all communication, hidden or not
    memory_s: float = 0.0  # the memory-bound part of compute_s

    @property
    def total_s(self) -> float:
        return self.compute_s + self.bubble_s + self.exposed_comm_s


def step_time(
    compute_s: float,
    bubble_s: float,
    entries: list[CommEntry],
    cluster: ClusterSpec,
    overlap: float,
    window_s: float = math.inf,
    memory_s: float = 0.0,
    hidden_s: float = 0.0,
) -> StepTime:
    """Compose the step: of the gradient traffic (GRADIENT_AXES), `overlap` of it may
    hide, but no more than `window_s`, the backward still running when its gradients are
    ready; `hidden_s` of the rest hides behind attention (the ring's key/value transfers,
    plan/context.py); everything else (TP, PP, all-to-alls) is exposed."""
    exposed = total = dp = 0.0
    for e in entries:
        t = entry_time(e, cluster)
        total += t
        if e.axis in GRADIENT_AXES:
            dp += t
        else:
            exposed += t
    exposed += dp - min(overlap * dp, window_s) - hidden_s
    return StepTime(compute_s, bubble_s, exposed, total, memory_s)
