"""LoRA's model state (parallel/lora.py): a frozen base and small trained adapters.

Per adapted (out, in) matrix of a block, rank r adds A (r, in) and B (out, r): r (in + out)
parameters. The base keeps its weights in the compute dtype and nothing else (no gradient,
no master copy, no moments); the adapters cost what any trained parameter costs. With
mixed-precision Adam, per GPU:

    2 N_base (1/k of it under ZeRO-3)  +  the 16 A of the table in memory.py for A adapters

against 16 N for a full fine-tune: for llama3-8b with rank 16 on every projection
(A = 42M, 0.5% of N) about an eighth (docs/planner.md).

`lora_model_state` is the formula for a layout's busiest GPU (N / (tp pp) base parameters,
the adapters of ceil(L / pp) blocks split over tp);
`lora_rank_model_state` counts one rank of our runtime exactly, buffer by buffer: the
adapters of a chunk are one flat buffer (ZeRO-1/2) or one per block (ZeRO-3's units),
and the frozen base stays whole in the module, or (ZeRO-3) in each unit's flat buffer of
frozen parameters, padded to a multiple of k on its own (fsdp_units.py).
"""

from __future__ import annotations

import math

from paratrain.models.plans import PLANS
from paratrain.plan.layout import Layout, LoraSpec, Workload
from paratrain.plan.memory import ModelState, local_params, model_state_bytes
from paratrain.plan.model import ModelSpec
from paratrain.plan.muon import block_matrices

Tensor = tuple[int, bool]  # (elements on one tp rank, split over tp)


def block_params(model: ModelSpec, lora: LoraSpec, tp: int = 1) -> int:
    """Adapter parameters of one block on one tp rank: r (in + out) per adapted (out, in)
    matrix, split as `adapter_tensors` says."""
    return sum(n for n, _ in adapter_tensors(model, lora, tp))


def adapter_tensors(model: ModelSpec, lora: LoraSpec, tp: int = 1) -> list[Tensor]:
    """One block's trained tensors under LoRA, as the block registers them: per target,
    A (r, in) then B (out, r); a column-parallel base's A whole and B split over tp, a
    row-parallel base's A split and B whole (parallel/lora.py split_lora)."""
    plan, r = PLANS[model.arch], lora.rank
    out: list[Tensor] = []
    for i in sorted(lora.targets):
        rows, cols = block_matrices(model.shape)[i]
        rowwise = plan.tensor_parallel[plan.lora_targets[i]] == "rowwise"
        out += [(r * cols // tp, True), (rows * r, False)] if rowwise else [
            (r * cols, False), (rows // tp * r, True)]  # fmt: skip
    return out


def adapter_params(model: ModelSpec, lora: LoraSpec) -> int:
    return block_params(model, lora) * (model.n_layer or 0)


def frozen_bytes(n_base: int, workload: Workload, layout: Layout) -> int:
    """The frozen base on one GPU: compute-dtype weights, a ceil(n / k) shard under ZeRO-3."""
    n = math.ceil(n_base / layout.shard_ranks) if layout.zero >= 3 else n_base
    return workload.precision.param_bytes * n


def lora_model_state(
    model: ModelSpec, lora: LoraSpec, workload: Workload, layout: Layout
) -> ModelState:
    """The busiest GPU's model state: its N / (tp pp) base frozen, its share of the
    adapters trained as memory.py counts any parameter."""
    base = local_params(model.params, layout.tp, layout.pp)
    blocks = math.ceil((model.n_layer or 0) / layout.pp)
    adapters = block_params(model, lora, layout.tp) * blocks
    state = model_state_bytes(adapters, workload, layout)
    return ModelState(
        params=state.params + frozen_bytes(base, workload, layout),
        grads=state.grads,
        optimizer=state.optimizer,
        master=state.master,
    )


def adapter_buffers(
    model: ModelSpec, lora: LoraSpec, layout: Layout, blocks: list[int]
) -> list[int]:
    """The adapters' flat buffers of one rank whose chunks hold `blocks` blocks each:
    one per chunk (ZeRO-1/2, and whole under DP), one per block (ZeRO-3's units)."""
    per_block = block_params(model, lora, layout.tp)
    if layout.zero >= 3:
        return [per_block] * sum(blocks)
    return [per_block * n for n in blocks if n]


def held_frozen_bytes(base_buffers: list[int], workload: Workload, layout: Layout) -> int:
    """The frozen base a rank holds: its chunks whole, or (ZeRO-3) a ceil(n / k) shard of
    every unit's buffer (`base_buffers`: rank_memory.flat_buffers' counts)."""
    k = layout.shard_ranks if layout.zero >= 3 else 1
    return workload.precision.param_bytes * sum(math.ceil(n / k) for n in base_buffers)


def adapter_activation_bytes(
    model: ModelSpec, workload: Workload, tp: int, device: str, r: int = 1
) -> float:
    """What LoRA changes in one block's saved tensors per micro-batch, without
    recomputation: each adapted matrix saves its (tokens, rank) product A x and the scaled
    copy of B that its addmm multiplies by (parallel/lora.py `add_update` makes b * scaling
    in every forward), in the activations' precision; and a Llama's composite rms_norm on
    the CPU no longer keeps its fp32 normalised input, which only its frozen weight's
    gradient needed: 4 h / r per token and norm less, r = tp under sequence parallelism
    (plan/llama_activations.py `cpu_norm_extra`)."""
    lora = workload.lora
    if lora is None or workload.recompute != "none":
        return 0.0
    tokens = model.shape.seq_len * workload.micro_batch
    pairs = adapter_tensors(model, lora, tp)  # A, B of each adapted matrix
    b_elements, matrices = sum(n for n, _ in pairs[1::2]), len(pairs) // 2
    added = (tokens * lora.rank * matrices + b_elements) * workload.precision.activation_bytes
    frozen_norms = (
        2 * 4 * model.shape.d_model / r * tokens
        if model.arch == "llama" and device == "cpu"
        else 0.0
    )
    return added - frozen_norms
