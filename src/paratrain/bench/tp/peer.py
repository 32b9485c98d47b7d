"""The peer of `paratrain bench tp`: PyTorch's DTensor tensor parallel on the same GPT.

`parallelize_gpt_dtensor` applies `torch.distributed.tensor.parallel.parallelize_module`
to a full GPT (built from the same seed as ours) with the layout of our `GPT_TP_PLAN`,
style for style:

| our style | DTensor style |
|---|---|
| `vocab_embedding` | `RowwiseParallel` on the embedding (vocabulary rows split) |
| `attention` (f once for q, k, v) | `PrepareModuleInput` on `attn`: one conversion of its input |
| `colwise` (q, k, v, fc) | `ColwiseParallel()`, local output |
| `rowwise` (proj) | `RowwiseParallel()` |
| `vocab_head` + `vocab_loss` | `ColwiseParallel(use_local_output=False)` + `loss_parallel()` |
| `replicated`, sequence parallel | `SequenceParallel()` on the LayerNorms; the position |
|  | embedding's output redistributed to this rank's positions |

`PrepareModuleInput` on `attn` and `mlp` is what torchtitan does too: q, k and v then
take the same DTensor input, and their input gradients (partial sums) are added before
one all-reduce (or one reduce-scatter under sequence parallelism), as with our `f`.
The peer's step is the harness's `torch_step` with `loss_parallel()` around forward and
backward (bench/harness/sides.py); its collectives are counted at the dispatcher
(bench/harness/bytes_sent.py).
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


def dtensor_plan(n_layer: int, sequence_parallel: bool) -> dict[str, Any]:
    """The DTensor plan equivalent to GPT_TP_PLAN, module name -> ParallelStyle."""
    # Under sequence parallelism the residual stream is (B, T/tp, C) on each rank: the
    # embedding reduce-scatters along T, the row-parallel outputs too, and the split
    # regions' inputs are all-gathered back to the whole sequence.
    seq = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, Any] = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "head": ColwiseParallel(input_layouts=seq, use_local_output=False),
    }
    if sequence_parallel:
        # Positions are looked up whole and this rank's T/tp rows kept (no traffic
        # forward; the gradient is all-gathered in backward, so the table's gradient is
        # whole without a separate sum).
        plan["pos_emb"] = PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(0)
        )
        plan["norm"] = SequenceParallel()
    for i in range(n_layer):
        block = f"blocks.{i}"
        for region in ("attn", "mlp"):
            plan[f"{block}.{region}"] = PrepareModuleInput(
                input_layouts=(seq,), desired_input_layouts=(Replicate(),)
            )
        for linear in ("attn.q", "attn.k", "attn.v", "mlp.fc"):
            plan[f"{block}.{linear}"] = ColwiseParallel()
        for linear in ("attn.proj", "mlp.proj"):
            plan[f"{block}.{linear}"] = RowwiseParallel(output_layouts=seq)
        if sequence_parallel:
            plan[f"{block}.ln1"] = SequenceParallel()
            plan[f"{block}.ln2"] = SequenceParallel()
    return plan


def describe_plan(plan: dict[str, Any]) -> str:
    """One line per distinct (module pattern, style), blocks collapsed to `blocks.*`."""
    seen: dict[str, str] = {}
    for name, style in plan.items():
        parts = name.split(".")
        if parts[0] == "blocks":
            parts[1] = "*"
        seen.setdefault(".".join(parts), repr(style))
    return "\n".join(f"  {name}: {style}" for name, style in seen.items())


def parallelize_gpt_dtensor(
    model: nn.Module, world: int, sequence_parallel: bool
) -> tuple[nn.Module, DeviceMesh, dict[str, Any]]:
    """Make a full GPT tensor parallel with DTensor over all `world` ranks, in place."""
    mesh = DeviceMesh("cpu", list(range(world)))
    plan = dtensor_plan(len(cast(nn.ModuleDict, model.blocks)), sequence_parallel)
    parallelize_module(model, mesh, plan)
    return model, mesh, plan


def build_peer_adamw(
    model: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float]
) -> torch.optim.AdamW:
    """Our AdamW (same groups, foreach=True), with DTensor and plain parameters kept in
    separate groups: a foreach kernel cannot take both kinds in one list."""
    groups = []
    for decay in (True, False):
        params = [p for p in model.parameters() if p.requires_grad and (p.dim() >= 2) == decay]
        for is_dtensor in (True, False):
            part = [p for p in params if isinstance(p, DTensor) == is_dtensor]
            if part:
                groups.append({"params": part, "weight_decay": weight_decay if decay else 0.0})
    return torch.optim.AdamW(groups, lr=lr, betas=betas, foreach=True)
