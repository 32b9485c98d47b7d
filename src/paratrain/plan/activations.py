"""Activation memory per GPU: one layer, one stage, the busiest GPU.

Activations per transformer layer and micro-batch (Korthikanti et al., arXiv:2205.05198,
section 4, 16-bit activations): s b h (34 + 5 a s / h) bytes; with tensor parallelism of
degree t and no sequence parallelism s b h (10 + 24 / t + 5 a s / (h t)); full
recomputation keeps only each layer's input, 2 s b h. The output layer adds 4 s b v / t
(fp32 logits). That is the GPT's count by default ("scores"); our GPT, with fused
attention (no score matrix) and no dropout masks, saves 0.6-0.7 of it, and is counted as
it runs by the "fused" variant (`fused_gpt_layer_activation_bytes`), which
`plan --validate` checks against the saved-tensor meter within 10%. Selective
recomputation is counted as our runtime runs it (parallel/recompute.py: matmul and
fused-attention outputs kept, the rest recomputed), not as Korthikanti's attention-core
variant (drop the 5 a s / (h t) scores), which saves nothing when a fused kernel keeps no
scores: `layer_activation_bytes`.
A Llama block is counted from what models/llama.py really saves, derived with Korthikanti's
method for its own layers (`llama_layer_activation_bytes`).
"""

from __future__ import annotations

from dataclasses import replace

from paratrain.plan import moe
from paratrain.plan.deferred_gradients import input_passes_alive
from paratrain.plan.head_memory import logits_bytes, zb_h1_logits_bytes
from paratrain.plan.layout import Layout, Workload
from paratrain.plan.llama_activations import cpu_norm_extra, llama_layer_activation_bytes
from paratrain.plan.lora import adapter_activation_bytes
from paratrain.plan.model import ModelSpec
from paratrain.plan.pipeline import stage_layers


def layer_activation_bytes(
    seq_len: int,
    micro_batch: int,
    d_model: int,
    n_head: int,
    tp: int,
    recompute: str,
    sequence_parallel: bool = False,
    element_bytes: int = 2,
) -> float:
    """Activation bytes one GPT layer keeps for one micro-batch, elements of e =
    `element_bytes` (16-bit by default).

    none: Korthikanti's count (module docstring), scaled from 16 bits to e; it ignores
    sequence parallelism. full: each layer's input, e h / r per token, r = t under
    sequence parallelism, else 1. selective: what our runtime's op-level policy keeps
    (parallel/recompute.py), per token, t = tp:

      block input (the checkpoint's)                             h / r
      q, k, v Linears' outputs (column-parallel)                 3h / t
      SDPA's output; its logsumexp per head                      h / t, and a / t fp32
      attention proj's output (row-parallel: the partial sum,
            whole, before the all-reduce or reduce-scatter)      h
      fc's output                                                4h / t
      MLP proj's output (partial sum; backward never reads it)   h

    so bytes = s b [e (h/r + 2h + 8h/t) + 4 a / t]. Recomputed: both LayerNorms, gelu,
    the residual adds, the reshape of the heads, the collectives. With attention dropout
    the fused kernel is recomputed (h/t and the logsumexp less); the planner has no
    dropout. CUDA's efficient-attention kernel pads the logsumexp to 32 positions.
    tests/test_recompute.py measures the block against this, at tp 1 and 2, with and
    without sequence parallelism.
    """
    s, b, h, a, t, e = seq_len, micro_batch, d_model, n_head, tp, element_bytes
    r = t if sequence_parallel else 1
    if recompute == "full":
        return e * s * b * h / r
    if recompute == "selective":
        return s * b * (e * (h / r + 2 * h + 8 * h / t) + 4 * a / t)
    per_sbh = 10 + 24 / t + 5 * a * s / (h * t)
    return s * b * h * per_sbh * e / 2


ATTENTIONS = ("scores", "fused")  # Korthikanti's count; what our GPT saves (SDPA)


def fused_gpt_layer_activation_bytes(
    seq_len: int,
    micro_batch: int,
    d_model: int,
    n_head: int,
    tp: int,
    sequence_parallel: bool = False,
    element_bytes: int = 2,
) -> float:
    """Activation bytes one block of our GPT (models/gpt.py) keeps for one micro-batch
    without recomputation, as it runs: fused attention (SDPA, which saves no s x s score
    matrix and recomputes the scores in backward) and dropout 0 (no masks).

    Korthikanti's method (arXiv:2205.05198, section 4), per token, in elements of e =
    `element_bytes` unless fp32 is said; r = t under sequence parallelism, else 1:

      ln1, ln2: their input; mean and rstd              2h / r, and 4 / r fp32
      q, k, v Linears: their input, ln1's output        h (one storage for three)
      SDPA: q, k, v, its output (proj's input: a view
            of the same storage); logsumexp per head    4h / t, and a / t fp32
      fc Linear: its input, ln2's output                h
      gelu: fc's output; MLP proj: gelu's output        8h / t
      residual adds, head reshapes                      nothing

    so bytes = s b [e (2h/r + 2h + 12h/t) + 4 (4/r + a/t)]: no s^2 term, where
    Korthikanti's has 5 a s / (h t) per s b h for the scores, their softmax and its
    dropout mask. At s = 128, h = 128, 4 heads, fp32: 16.06 (b, T, C) tensors a block,
    where his count, made fp32, says 27.0. The layer inputs of the column-parallel
    Linears stay whole under sequence parallelism (our layers keep the gathered input).
    tests/test_validate_measured.py measures the block, and `plan --validate` whole
    stages at tp 1 and 2.
    """
    s, b, h, a, t, e = seq_len, micro_batch, d_model, n_head, tp, element_bytes
    r = t if sequence_parallel else 1
    return s * b * (e * (2 * h / r + 2 * h + 12 * h / t) + 4 * (4 / r + a / t))


def head_activation_bytes(
    model: ModelSpec, micro_batch: int, element_bytes: int, device: str = "cuda", r: int = 1
) -> float:
    """What the last stage's final norm and head keep besides the fp32 logits, per
    micro-batch, for the fused variant: the norm's input and statistics, and the head's
    input (the norm's output; whole under tensor parallelism, whose head splits the
    vocabulary, and gathered whole under sequence parallelism, r = t, which splits the
    norm's tokens). GPT's LayerNorm: s b (e h (1 + 1 / r) + 8 / r), mean and rstd.
    Llama's rms_norm: s b (e h (1 + 1 / r) + 4 / r), its rms, and on the CPU the
    composite's fp32 copies (cpu_norm_extra). The token ids and targets (int64, 8 bytes
    a token) are left out: under 0.1% of a block."""
    s, h, e = model.shape.seq_len, model.shape.d_model, element_bytes
    if model.arch == "llama":
        stats = 4 / r + cpu_norm_extra(h, r, e, device)
    else:
        stats = 8 / r
    return s * micro_batch * (e * h + e * h / r + stats)


def head_bytes(
    model: ModelSpec, workload: Workload, layout: Layout, attention: str, device: str
) -> float:
    """What one micro-batch keeps at the head, on the last stage: the fp32 logits,
    4 s b V / t, and for "fused" the final norm's and the head's inputs too."""
    b, t = workload.micro_batch, layout.tp
    logits = logits_bytes(model, workload, layout)
    if attention == "fused":
        e, r = workload.precision.activation_bytes, t if layout.sequence_parallel else 1
        logits += head_activation_bytes(model, b, e, device, r)
    return logits


def loss_transient_bytes(model: ModelSpec, workload: Workload, tp: int) -> float:
    """What the loss holds at its peak, for one micro-batch, beyond the 4 s b V / t of
    fp32 logits the stage count charges (stage_activation_bytes); the planner's peak
    memory adds it on the last stage (simulate compares it). In elements of e:

    tp = 1, nn.CrossEntropyLoss, in the logits' dtype: its log-softmax saves its output
    (e, where the charge is 4), and its backward holds beside it the loss's gradient (e)
    and then the logits' (e): 3 e s b V in all, (3 e - 4) s b V beyond the charge.
    tp > 1, VocabParallelCrossEntropy (parallel/tensor_parallel/loss.py): the logits
    (e), their fp32 copy (none when they are fp32) and the shifted exponentials that
    become the saved softmax (4), per token and vocabulary entry of the rank:
    (e + 4 [e != 4]) s b V / t beyond the charge. Its backward holds as much: the
    softmax, its fp32 clone and the gradient in e.
    tests/test_simulate.py measures both, in fp32 and bf16."""
    s, v, b = model.shape.seq_len, model.shape.vocab_size, workload.micro_batch
    e = workload.precision.activation_bytes
    if tp == 1:
        return (3 * e - 4) * s * b * v
    return (e + (4 if e != 4 else 0)) * s * b * v / tp


def block_activation_bytes(
    model: ModelSpec,
    workload: Workload,
    tp: int,
    attention: str = "scores",
    device: str = "cuda",
    sequence_parallel: bool = False,
) -> float:
    """One layer's activation bytes in the workload's precision (element size), the
    norms' tokens split over tp under `sequence_parallel`.

    `attention` picks the GPT's count without recomputation: "scores", Korthikanti's (the
    seeds' figures, and `paratrain plan`'s default), or "fused", our runtime's
    (`fused_gpt_layer_activation_bytes`), which `plan --validate` checks. The Llama is
    counted as it runs either way, on `device`'s kernels (its CPU norms keep more)."""
    p, b, recompute = workload.precision, workload.micro_batch, workload.recompute
    if model.num_experts:  # the busiest rank's experts: k f wide, times the imbalance
        model = moe.dense_equivalent(model, workload.moe_imbalance)
    r = tp if sequence_parallel else 1
    adapters = (
        adapter_activation_bytes(model, workload, tp, device, r) if attention == "fused" else 0.0
    )
    if model.arch == "llama":
        return adapters + llama_layer_activation_bytes(
            model, b, tp, recompute, sequence_parallel, p.activation_bytes, device
        )
    s, h, a = model.shape.seq_len, model.shape.d_model, model.shape.n_head
    e, sp = p.activation_bytes, sequence_parallel
    if attention == "fused" and recompute == "none":
        return adapters + fused_gpt_layer_activation_bytes(s, b, h, a, tp, sp, element_bytes=e)
    return layer_activation_bytes(s, b, h, a, tp, recompute, sp, element_bytes=e)


def in_flight_chunks(layout: Layout, microbatches: int, stage: int = 0) -> int:
    """(micro-batch, chunk) forward graphs that `stage` holds at its peak.

    No pipeline: 1 (accumulation runs micro-batches one after another). GPipe
    (arXiv:1811.06965): all K forwards before any backward, K. 1F1B (PipeDream-Flush,
    arXiv:2006.09503): S - stage - 1 warm-up forwards, then one more before the first
    backward, so min(K, S - stage). Interleaved 1F1B (arXiv:2104.04473): stage s warms up
    2(S - s - 1) + (v - 1) S chunk-forwards and then holds one more, at most v K. These
    are the runtime's schedules (parallel/pipeline/schedules.py), counted as its checker
    and its trace count them.

    ZB-H1 (arXiv:2401.10241): 1F1B's warm-up, but stage s defers up to s weight-gradient
    passes, and our runtime keeps a micro-batch's whole graph until its W (autograd with
    retain_graph), so every stage holds min(K, S). Qi et al. count ZB-H1's peak as 1F1B's
    because an implementation can free what W does not need after B; ours does not.
    """
    k, s, v = microbatches, layout.pp, layout.chunks
    if s == 1:
        return 1
    if layout.schedule == "gpipe":
        return k
    if layout.schedule == "zb-h1":
        return min(k, s)
    if layout.schedule == "1f1b":
        return min(k, s - stage)
    return min(k * v, 2 * (s - stage - 1) + (v - 1) * s + 1)


def in_flight_microbatches(layout: Layout, microbatches: int, stage: int = 0) -> float:
    """Micro-batches whose activations `stage` holds at its peak, in stage units.

    Each chunk is 1/v of a stage, so the interleaved schedule's stage 0 holds
    (2(S - 1) + (v - 1) S + 1) / v = S + (S - 1) / v stage units (see in_flight_chunks).
    """
    return in_flight_chunks(layout, microbatches, stage) / layout.chunks


def stage_activation_bytes(
    model: ModelSpec,
    workload: Workload,
    layout: Layout,
    microbatches: int,
    stage: int,
    attention: str = "scores",
    device: str = "cuda",
) -> float | None:
    """Peak activation bytes of pipeline stage `stage` (any stage with pp = 1), on
    `device`'s kernels.

    Context parallelism divides all of it by cp: every term counts tokens, and a cp rank
    holds s / cp of them (the s x s scores of "scores" become s/cp x s). What does not
    shrink is outside this count: the model states, and the ring's key/value chunk in
    flight (plan/context.py `ring_buffer_bytes`, added by estimate.py).

    In-flight micro-batches x the stage's layers (as the runtime splits them: 126 layers
    over 16 stages give some 8 and some 7) x one layer's count, plus the fp32
    logits on the stage that holds the head: once per micro-batch in flight there (K for
    GPipe, whose last stage also runs every forward first; 1 otherwise). `attention` as in
    `block_activation_bytes`; "fused" also counts the final LayerNorm's and the head's
    inputs (`head_activation_bytes`), so that it is the whole stage as it runs. ZB-H1's
    last stage keeps min(K, S) graphs until their deferred W, but only from the head
    down: the loss above it, whose log-softmax holds the logits, goes as BI ends (BW
    holds the head's node, not the loss), so the logits count once (`zb_h1_logits_bytes`)
    and the heads' inputs min(K, S) times (zb-h1 zero2 pp 4 with 8 KiB buckets, the last
    stage: -7.2% with the logits of every graph, docs/planner.md).
    """
    if workload.activation_bytes_override is not None:
        return workload.activation_bytes_override
    if not model.has_shape:
        return None
    t, sp = layout.tp, layout.sequence_parallel
    per_layer = block_activation_bytes(model, workload, t, attention, device, sp)
    layers = stage_layers(model.shape.n_layer, stage, layout.pp, layout.chunks)
    held = in_flight_microbatches(layout, microbatches, stage) * layers * per_layer
    if workload.recompute == "selective":  # ZB-H1's BI recomputes, and keeps it for BW
        whole = replace(workload, recompute="none")
        saved = block_activation_bytes(model, whole, t, attention, device, sp) - per_layer
        held += input_passes_alive(layout, microbatches, stage) * layers * saved
    if stage == layout.pp - 1:
        last_held = {"gpipe": microbatches, "zb-h1": min(microbatches, layout.pp)}
        heads = last_held.get(layout.schedule, 1)
        once = zb_h1_logits_bytes(model, workload, layout, stage)
        held += heads * (head_bytes(model, workload, layout, attention, device) - once) + once
    return held / layout.cp


def activation_bytes(
    model: ModelSpec, workload: Workload, layout: Layout, microbatches: int
) -> float | None:
    """Peak activation bytes on the busiest GPU, or None when the model has no shape.

    The first stage holds the most micro-batches; the last holds the logits. In the
    precision's activation element size (block_activation_bytes).
    """
    first = stage_activation_bytes(model, workload, layout, microbatches, 0)
    if first is None or layout.pp == 1:
        return first
    last = stage_activation_bytes(model, workload, layout, microbatches, layout.pp - 1)
    return first if last is None else max(first, last)  # both or neither have a shape
