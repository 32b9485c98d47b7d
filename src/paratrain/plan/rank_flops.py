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

Predicted where the step's work splits evenly over the ranks: no pipeline (stages hold
different layers), no context parallelism (its blocks are not SDPA's), no experts (the
router decides the work). Otherwise None.
"""

from __future__ import annotations

from paratrain.models.presets import ffn_width
from paratrain.plan.layout import Layout, Workload
from paratrain.plan.model import ModelSpec
from paratrain.plan.time import counted_by_shape, model_training_flops


def fused_attention_recompute_flops(model: ModelSpec, tokens: int) -> int:
    """The backward's extra q k^T product: 2 s h per token per layer (module docstring)."""
    return 2 * model.n_layer * model.seq_len * model.d_model * tokens  # type: ignore[operator]


def early_stopped_flops(model: ModelSpec, tokens: int) -> int:
    """The product a full recomputation does not run again, which GPT's count includes:
    each block's last, the MLP's down projection, 2 h f per token per layer."""
    h, f = model.d_model, ffn_width(model.shape)
    return 2 * model.n_layer * h * f * tokens  # type: ignore[operator]


def rank_step_flops(model: ModelSpec, workload: Workload, layout: Layout) -> int | None:
    """This rank's matmul FLOPs in one step (forward, backward), or None where not even."""
    uneven = layout.pp > 1 or layout.cp > 1 or model.num_experts
    if uneven or workload.global_batch is None:
        return None
    tokens = workload.global_batch * model.seq_len  # type: ignore[operator]
    full = workload.recompute == "full"
    total = model_training_flops(model, tokens, "full" if full else "none")
    total += fused_attention_recompute_flops(model, tokens)
    if full and counted_by_shape(model):  # GPT: the convention's count (docstring)
        total -= early_stopped_flops(model, tokens)
    return round(total / layout.world)
