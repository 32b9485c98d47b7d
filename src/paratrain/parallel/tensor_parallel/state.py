"""Facts about a tensor-parallel model that a training step needs, and its full weights.

- `sharded_parameters`: which parameters are split, and along which dimension; the global
  gradient norm (train/clip.py) sums their squares over the tp group and counts every
  replicated parameter once.
- `sequence_parallel_parameters`: under sequence parallelism a replicated parameter
  (LayerNorm, position embedding, row-parallel bias) sees only this rank's tokens, so its
  gradient is a partial sum that the training step completes with one all-reduce over tp
  (Korthikanti et al., arXiv:2205.05198, section 4.2.2), wherever the data-parallel
  wrapper keeps it (`Replica.all_reduce_grads_`).
- `full_state_dict`: every parameter whole again, under the plain model's names, for the
  equivalence tests and for checkpoints that do not depend on tp.

Which parameters are split is read from the layers (`tp_shard_dims`), which parameters
are partial from `sequence_parallel_params`: module attributes, so a pipeline split or a
data-parallel wrapper that keeps the modules keeps the facts.
"""

from __future__ import annotations

import torch
from torch import nn

from paratrain.comm import regions
from paratrain.comm.group import CommGroup


def split_dims(model: nn.Module) -> dict[str, int]:
    """{name: dimension it is split along} for every tp-split parameter, by the modules'
    records alone (a sharded wrapper may hold the values elsewhere)."""
    return {
        f"{mod_name}.{p_name}" if mod_name else p_name: dim
        for mod_name, module in model.named_modules()
        for p_name, dim in getattr(module, "tp_shard_dims", {}).items()
    }


def sharded_parameters(model: nn.Module) -> dict[str, tuple[nn.Parameter, int]]:
    """{name: (parameter, dimension it is split along)} for every tp-split parameter."""
    out = {}
    for name, dim in split_dims(model).items():
        mod_name, _, p_name = name.rpartition(".")
        param = getattr(model.get_submodule(mod_name), p_name)
        if param is not None:
            out[name] = (param, dim)
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
        state[name] = regions.gather_slices(tensor.detach(), group, dim=sharded[name][1]).clone()
    return state
