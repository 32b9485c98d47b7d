"""Activation bytes of one Llama block (models/llama.py), derived as it runs.

Korthikanti et al.'s method (arXiv:2205.05198, section 4: list what each op saves for
backward), our derivation for the block as it runs. Per token, in elements of e =
`element_bytes` unless fp32 is said; f = ffn_hidden, d = h / a, r = t under sequence
parallelism, else 1:

  attn_norm, mlp_norm (fused rms_norm): input, rms      2h / r, and 2 / r fp32
  q, k, v Linears: their input, the norm's output       h (one storage for three)
  rotary, x * cos + rotate(x) * sin: the tables, not x  (per sequence, below)
  repeat_interleave of k and v to all a heads           nothing
  SDPA: q, the repeated k and v, its output; o: a view
        of that output; logsumexp per head              4h / t, and a / t fp32
  residual adds                                         nothing
  gate, up Linears: their input, the norm's output      h (one storage for two)
  silu(g): g; silu(g) * u: both factors; down: the
        product p; so g, u, silu(g), p                  4f / t

and per sequence the rotary cos and sin, 2 s d, one pair for q and k (models/llama.py
computes them once per layer), whole on every rank. So
bytes = s b [e (2h/r + 2h + (4h + 4f)/t) + 4 (2/r + a/t)] + 2 e s d.
No s^2 term: SDPA saves no score matrix (its kernel recomputes the scores in backward),
so Korthikanti's selective recomputation would have nothing to drop; no dropout. GQA
does not shrink k and v: attention repeats them to all heads before SDPA, which keeps
the copies (SDPA's enable_gqa would keep 2 (h - d_kv) / t per token less). Tensor
parallelism splits heads and f (models/plans.py); the norms' outputs stay whole even
under sequence parallelism, because our column-parallel layers keep the all-gathered
input where Megatron keeps the local part and gathers it again in backward. Full
recomputation keeps each block's input, e h / r per token. The norms are torch's fused
kernel (`_fused_rms_norm`, CUDA). On the CPU rms_norm is composite (ATen's
rms_norm_composite: x in fp32, times rsqrt(mean(x^2) + eps), times w, then back to x's
dtype), and autograd keeps the fp32 input (x itself when x is fp32) and the fp32
normalised input where the fused kernel keeps x: (8 - e) h / r more per token and norm
(`device="cpu"`). tests/test_plan_llama.py measures the block at tp 1 and 2, with and
without sequence parallelism, in fp32 and bf16, and finds exactly this.

Selective recomputation (parallel/recompute.py: keep matmul and fused-attention
outputs) keeps, per token, d_kv = n_kv_head d:

  block input (the checkpoint's)                             h / r
  q's output; k's and v's, before the repeat to all heads    h / t; 2 d_kv / t
  SDPA's output; its logsumexp per head                      h / t; a / t fp32
  o's output (row-parallel: the partial sum, whole)          h
  gate's and up's outputs                                    2f / t
  down's output (partial sum; backward never reads it)       h

so bytes = s b [e (h/r + 2h + (2h + 2 d_kv + 2f)/t) + 4 a / t]. Recomputed: the norms
(and their rms), rotary and its tables, the repeat of k and v, silu and the product,
the residual adds, the collectives. tests/test_recompute.py measures it, exactly.
"""

from __future__ import annotations

from paratrain.models.presets import ffn_width, kv_heads
from paratrain.plan.model import ModelSpec


def llama_layer_activation_bytes(
    model: ModelSpec,
    micro_batch: int,
    tp: int,
    recompute: str,
    sequence_parallel: bool = False,
    element_bytes: int = 2,
    device: str = "cuda",
) -> float:
    """Activation bytes one Llama block (models/llama.py) keeps for one micro-batch,
    in elements of `element_bytes` on `device`'s kernels (the module docstring derives
    each term)."""
    s, b, t, e = model.shape.seq_len, micro_batch, tp, element_bytes
    h, a = model.shape.d_model, model.shape.n_head
    r = t if sequence_parallel else 1
    if recompute == "full":
        return e * s * b * h / r
    if recompute == "selective":
        d_kv = kv_heads(model.shape) * (h // a)
        kept = h / r + 2 * h + (2 * h + 2 * d_kv + 2 * ffn_width(model.shape)) / t
        return s * b * (e * kept + 4 * a / t)
    per_token = e * (2 * h / r + 2 * h + (4 * h + 4 * ffn_width(model.shape)) / t)
    per_token += 4 * (2 / r + a / t)  # fp32 statistics
    per_token += 2 * cpu_norm_extra(h, r, e, device)
    rotary = e * 2 * s * (h // a)  # cos and sin, shared by q and k
    return s * b * per_token + rotary


def cpu_norm_extra(h: int, r: int, element_bytes: int, device: str) -> float:
    """Bytes per token one rms_norm keeps on `device` beyond the fused kernel's input:
    the CPU's composite keeps the fp32 input and the fp32 normalised input (8 h) where
    the fused kernel keeps the input (e h); r splits the tokens (sequence parallelism)."""
    return (8 - element_bytes) * h / r if device == "cpu" else 0.0
