"""What a training step needs around a tensor-parallel model: gradients and full weights.

- `sync_sequence_parallel_grads`: under sequence parallelism a replicated parameter
  (LayerNorm, position embedding, row-parallel bias) sees only this rank's tokens, so its
  gradient is a partial sum; one flat all-reduce completes it (Korthikanti et al.,
  arXiv:2205.05198, section 4.2.2). Without sequence parallelism it does nothing: the
  gradients of replicated parameters are whole and equal on every tp rank already.
- `clip_grad_norm_`: the global norm counts each split parameter's shards once each (their
  squared norms are summed over the group) and each replicated parameter once.
- `full_state_dict`: every parameter whole again, under the plain model's names, for the
  equivalence tests and for checkpoints that do not depend on tp.

Which parameters are split is read from the layers (`tp_shard_dims`), which parameters
are partial from `sequence_parallel_params`: module attributes, so a pipeline split or a
data-parallel wrapper that keeps the modules keeps the facts.
"""

from __future__ import annotations

import torch
from torch import nn

from paratrain import comm
from paratrain.comm import regions
from paratrain.comm.group import CommGroup


def sharded_parameters(model: nn.Module) -> dict[str, tuple[nn.Parameter, int]]:
    """{name: (parameter, dimension it is split along)} for every tp-split parameter."""
    out = {}
    for mod_name, module in model.named_modules():
        for p_name, dim in getattr(module, "tp_shard_dims", {}).items():
            param = getattr(module, p_name)
            if param is not None:
                out[f"{mod_name}.{p_name}" if mod_name else p_name] = (param, dim)
    return out


def sequence_parallel_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Replicated parameters whose gradients are partial under sequence parallelism."""
    params = []
    for module in model.modules():
        for p_name in getattr(module, "sequence_parallel_params", ()):
            param = getattr(module, p_name)
            if param is not None and param.requires_grad:
                params.append(param)
    return params


def sync_sequence_parallel_grads(model: nn.Module, group: CommGroup) -> None:
    """Sum over the tp group the gradients that sequence parallelism left partial.

    Call once per optimizer step, after the last backward and before clipping: gradients
    accumulated over micro-batches are summed once, like data parallelism's.
    """
    params = sequence_parallel_parameters(model)
    if group.size == 1 or not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.all_reduce(flat, group, op="sum")
    offset = 0
    for p, g in zip(params, grads, strict=True):
        p.grad = flat[offset : offset + g.numel()].view_as(g).clone()
        offset += g.numel()


def grad_norm(model: nn.Module, group: CommGroup) -> torch.Tensor:
    """The L2 norm of the whole model's gradient, equal on every tp rank."""
    split_ids = {id(p) for p, _ in sharded_parameters(model).values()}
    squares = torch.zeros(2, dtype=torch.float32)  # (split, replicated)
    for p in model.parameters():
        if p.grad is not None:
            squares[0 if id(p) in split_ids else 1] += p.grad.detach().float().pow(2).sum()
    split_sq = comm.all_reduce(squares[:1].clone(), group, op="sum")
    return (split_sq[0] + squares[1]).sqrt()


def clip_grad_norm_(model: nn.Module, max_norm: float, group: CommGroup) -> torch.Tensor:
    """Scale the gradients so that their global norm is at most max_norm; return the norm.

    The same rule as `torch.nn.utils.clip_grad_norm_` (scale by min(1, max / (norm + 1e-6))),
    with the norm taken over the whole, unsplit model.
    """
    total = grad_norm(model, group)
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, scale)
    return total


def full_state_dict(model: nn.Module, group: CommGroup) -> dict[str, torch.Tensor]:
    """Every parameter and buffer whole, under the plain model's names. Collective: every
    tp rank must call it."""
    sharded = sharded_parameters(model)
    state = {}
    for name, tensor in model.state_dict().items():
        if name not in sharded:
            state[name] = tensor.detach().clone()
            continue
        # Not differentiable here (detached); the same gather along a dimension as the
        # layers use for their outputs.
        state[name] = regions.gather(tensor.detach(), group, dim=sharded[name][1]).clone()
    return state
