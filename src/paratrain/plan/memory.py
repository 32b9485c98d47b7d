"""Memory per GPU: model states itemised (ZeRO's accounting) and activations.

Model states (ZeRO, arXiv:1910.02054, section 3.1; seeds, definition 9.2.3): with
mixed-precision Adam each parameter costs 2 bytes of weights, 2 of gradient, 4 + 4 of
moments and 4 of fp32 master weights, 16N in all. Tensor and pipeline parallelism divide
N among tp * pp GPUs; ZeRO then shards over the dp group of k GPUs:

    stage:      params   grads   optimizer + master
    0 (DP)        1        1           1
    1             1        1          1/k
    2             1       1/k         1/k
    3 (FSDP)     1/k      1/k         1/k

A sharded flat buffer is padded to a multiple of k, so a shard is ceil(n / k) elements.

ZeRO-2 with accumulate "shard" (the default, the runtime's and DeepSpeed's) reduce-scatters
gradients into the shard after every micro-batch (K-fold traffic, comm.py), so its model
state is the table's row, 2N + 14N/k with mixed-precision Adam (the seeds, ZeRO's
figure 1). With K > 1 micro-batches and accumulate "full" it also holds the whole
gradient, n x grad bytes, from the first micro-batch's backward until the one reduce-scatter
after the last (parallel/data_parallel/zero.py): `grad_accumulation`, a transient item
counted in the total (it is alive at the peak, during the last backward) but not at the step
boundary. Beside the ceil(n / k) shard it makes the peak exceed ZeRO-1's by that shard. With
"shard", and for K = 1, the item is 0.

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

import math
from dataclasses import dataclass

from paratrain.models.presets import ffn_width, kv_heads
from paratrain.plan import moe
from paratrain.plan.layout import Layout, Workload
from paratrain.plan.model import ModelSpec


@dataclass(frozen=True)
class ModelState:
    """Model-state bytes on one GPU, by kind (the seeds' table 9.2.3 columns), and the
    transient whole gradient of ZeRO-2's "full" accumulation (module docstring)."""

    params: int
    grads: int
    optimizer: int  # all moments (Adam: m and v)
    master: int  # fp32 master weights
    grad_accumulation: int = 0  # transient: alive during the step, gone at its boundary

    @property
    def total(self) -> int:
        """The peak: the step-boundary items plus the transient one."""
        return self.params + self.grads + self.grad_accumulation + self.optimizer + self.master

    @property
    def step_boundary(self) -> int:
        """What is held between steps (the seeds' totals, the runtime's record)."""
        return self.total - self.grad_accumulation

    def as_dict(self) -> dict[str, int]:
        return {
            "params": self.params,
            "grads": self.grads,
            "grad_accumulation": self.grad_accumulation,
            "optimizer": self.optimizer,
            "master": self.master,
            "total": self.total,
        }


def local_params(n_params: int, tp: int, pp: int) -> int:
    """Parameters held by one GPU before ZeRO: N / (tp * pp), rounded up.

    An approximation for real models (LayerNorms are replicated across tp, embeddings and
    head sit on the end stages); exact when tp = pp = 1.
    """
    return math.ceil(n_params / (tp * pp))


def holds_whole_gradient(workload: Workload, layout: Layout, microbatches: int) -> bool:
    """True for ZeRO-2 accumulating the whole gradient over K > 1 micro-batches."""
    full = workload.zero2_accumulate == "full"
    return layout.zero == 2 and layout.data_ranks > 1 and full and microbatches > 1


def model_state_bytes(
    n_params: int, workload: Workload, layout: Layout, microbatches: int = 1
) -> ModelState:
    """Bytes of parameters, gradients, optimizer moments and master weights on one GPU,
    and ZeRO-2's transient whole gradient when it accumulates K = `microbatches` > 1.
    ZeRO shards over the dp_cp group (the cp ranks hold the same parameters)."""
    n = local_params(n_params, layout.tp, layout.pp)
    shard = math.ceil(n / layout.data_ranks)  # elements of one ZeRO shard
    p = workload.precision
    z = layout.zero
    whole = holds_whole_gradient(workload, layout, microbatches)
    return ModelState(
        params=p.param_bytes * (shard if z >= 3 else n),
        grads=p.grad_bytes * (shard if z >= 2 else n),
        optimizer=workload.moments * p.moment_bytes * (shard if z >= 1 else n),
        master=p.master_bytes * (shard if z >= 1 else n),
        grad_accumulation=p.grad_bytes * n if whole else 0,
    )


def redundant_bytes(
    n_params: int, workload: Workload, layout: Layout, state: ModelState | None = None
) -> int:
    """Model-state bytes held more than once across the job: (k - 1) * 16N for plain DP.
    `state`: one GPU's, when it is not `model_state_bytes`'s (a mixture of experts')."""
    per_gpu = (state or model_state_bytes(n_params, workload, layout)).step_boundary
    return max(0, layout.world * per_gpu - workload.state_bytes_per_param * n_params)


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


def llama_layer_activation_bytes(
    model: ModelSpec,
    micro_batch: int,
    tp: int,
    recompute: str,
    sequence_parallel: bool = False,
    element_bytes: int = 2,
) -> float:
    """Activation bytes one Llama block (models/llama.py) keeps for one micro-batch.

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

    and per sequence the rotary cos and sin of q and of k, 4 s d, whole on every rank. So
    bytes = s b [e (2h/r + 2h + (4h + 4f)/t) + 4 (2/r + a/t)] + 4 e s d.
    No s^2 term: SDPA saves no score matrix (its kernel recomputes the scores in backward),
    so Korthikanti's selective recomputation would have nothing to drop; no dropout. GQA
    does not shrink k and v: attention repeats them to all heads before SDPA, which keeps
    the copies (SDPA's enable_gqa would keep 2 (h - d_kv) / t per token less). Tensor
    parallelism splits heads and f (models/plans.py); the norms' outputs stay whole even
    under sequence parallelism, because our column-parallel layers keep the all-gathered
    input where Megatron keeps the local part and gathers it again in backward. Full
    recomputation keeps each block's input, e h / r per token. The norms are torch's fused
    kernel (`_fused_rms_norm`, CUDA); on CPU rms_norm is composite and also keeps the
    normalised input, 2h / r in fp32.
    tests/test_plan_llama.py measures the block at tp 1 and 2, with and without sequence
    parallelism, and finds exactly this plus that CPU term.

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
    s, b, t, e = model.seq_len, micro_batch, tp, element_bytes
    h, a = model.d_model, model.n_head
    assert s is not None and h is not None and a is not None, "activations need the shape"
    r = t if sequence_parallel else 1
    if recompute == "full":
        return e * s * b * h / r
    if recompute == "selective":
        d_kv = kv_heads(model) * (h // a)  # type: ignore[arg-type]
        kept = h / r + 2 * h + (2 * h + 2 * d_kv + 2 * ffn_width(model)) / t  # type: ignore[arg-type]
        return s * b * (e * kept + 4 * a / t)
    per_token = e * (2 * h / r + 2 * h + (4 * h + 4 * ffn_width(model)) / t)  # type: ignore[arg-type]
    per_token += 4 * (2 / r + a / t)  # fp32 statistics
    rotary = e * 4 * s * (h // a)
    return s * b * per_token + rotary


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
    tests/test_activation_variant.py measures the block, and `plan --validate` whole
    stages at tp 1 and 2.
    """
    s, b, h, a, t, e = seq_len, micro_batch, d_model, n_head, tp, element_bytes
    r = t if sequence_parallel else 1
    return s * b * (e * (2 * h / r + 2 * h + 12 * h / t) + 4 * (4 / r + a / t))


def head_activation_bytes(model: ModelSpec, micro_batch: int, element_bytes: int) -> float:
    """What the last stage's final LayerNorm and head keep besides the fp32 logits, per
    micro-batch, for the fused variant: the norm's input, mean and rstd, and the head's
    input (the norm's output; whole under tensor parallelism, whose head splits the
    vocabulary), s b (2 e h + 8). The token ids and targets (int64, 8 bytes
    a token) are left out: under 0.1% of a block."""
    s, h = model.seq_len, model.d_model
    return s * micro_batch * (2 * element_bytes * h + 8)  # type: ignore[operator]


def block_activation_bytes(
    model: ModelSpec, workload: Workload, tp: int, attention: str = "scores"
) -> float:
    """One layer's activation bytes in the workload's precision (element size).

    `attention` picks the GPT's count without recomputation: "scores", Korthikanti's (the
    seeds' figures, and `paratrain plan`'s default), or "fused", our runtime's
    (`fused_gpt_layer_activation_bytes`), which `plan --validate` checks. The Llama is
    counted as it runs either way."""
    p, b, recompute = workload.precision, workload.micro_batch, workload.recompute
    if model.num_experts:  # the busiest rank's experts: k f wide, times the imbalance
        model = moe.dense_equivalent(model, workload.moe_imbalance)
    if model.arch == "llama":
        return llama_layer_activation_bytes(
            model, b, tp, recompute, element_bytes=p.activation_bytes
        )
    h, a = model.d_model, model.n_head
    e = p.activation_bytes
    if attention == "fused" and recompute == "none":
        return fused_gpt_layer_activation_bytes(model.seq_len, b, h, a, tp, element_bytes=e)  # type: ignore[arg-type]
    return layer_activation_bytes(model.seq_len, b, h, a, tp, recompute, element_bytes=e)  # type: ignore[arg-type]


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
) -> float | None:
    """Peak activation bytes of pipeline stage `stage` (any stage with pp = 1).

    Context parallelism divides all of it by cp: every term counts tokens, and a cp rank
    holds s / cp of them (the s x s scores of "scores" become s/cp x s). What does not
    shrink is outside this count: the model states, and the ring's key/value chunk in
    flight (plan/context.py `ring_buffer_bytes`, added by estimate.py).

    In-flight micro-batches x the stage's layers x one layer's count, plus the fp32
    logits on the stage that holds the head: once per micro-batch in flight there (K for
    GPipe, whose last stage also runs every forward first; min(K, S) for ZB-H1, whose last
    stage keeps graphs until their deferred W; 1 otherwise). `attention` as in
    `block_activation_bytes`; "fused" also counts the final LayerNorm's and the head's
    inputs (`head_activation_bytes`), so that it is the whole stage as it runs.
    """
    if workload.activation_bytes_override is not None:
        return workload.activation_bytes_override
    if not model.has_shape:
        return None
    s, b, t = model.seq_len, workload.micro_batch, layout.tp
    per_layer = block_activation_bytes(model, workload, t, attention)
    stage_layers = math.ceil(model.n_layer / layout.pp)  # type: ignore[operator]
    held = in_flight_microbatches(layout, microbatches, stage) * stage_layers * per_layer
    if stage == layout.pp - 1:
        logits = 4 * s * b * model.vocab_size / t  # type: ignore[operator]
        if attention == "fused" and model.arch != "llama":
            logits += head_activation_bytes(model, b, workload.precision.activation_bytes)
        last_held = {"gpipe": microbatches, "zb-h1": min(microbatches, layout.pp)}
        held += logits * last_held.get(layout.schedule, 1)
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
    return max(first, last)  # type: ignore[type-var]
