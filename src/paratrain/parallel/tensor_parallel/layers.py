"""Megatron's tensor-parallel layers (Shoeybi et al., arXiv:1909.08053, section 3).

Each layer is made from the full `nn.Linear` / `nn.Embedding` of a model that every rank
built from the same seed, and keeps only this rank's slice ("build full, then slice"), so
every layout starts from the same weights as the single-device model.

A column-parallel layer followed by a row-parallel one needs no communication in between:
the column-parallel output stays split along its features, which is exactly the input the
row-parallel layer wants. Forward traffic is the one all-reduce (`g`) after the row-parallel
layer; backward traffic is the one all-reduce (`f`) of the column-parallel input gradient.

Activations are (B, T, C) with the sequence at dim -2; token ids are (B, T) with the
sequence last. Parameter names stay `weight` and `bias`, so a tensor-parallel model has
the same state-dict keys as the plain one; `tp_shard_dims` says along which dimension
each parameter is split, and `sequence_parallel_params` names the replicated parameters
whose gradients are partial under sequence parallelism (they see only local tokens).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.comm import regions
from paratrain.comm.group import CommGroup
from paratrain.parallel.lora import with_lora


def shard_size(full: int, group: CommGroup, what: str) -> int:
    """full / tp, or a ValueError that names both sizes."""
    if full % group.size:
        raise ValueError(f"{what} {full} is not divisible by tp={group.size}")
    return full // group.size


def _slice(t: torch.Tensor, dim: int, group: CommGroup) -> nn.Parameter:
    n = t.shape[dim] // group.size
    piece = t.detach().narrow(dim, group.rank * n, n).clone()
    return nn.Parameter(piece, requires_grad=t.requires_grad)  # a frozen base stays frozen


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W split by output features: rank r computes its slice of y.

    The input must be the same on every rank. `f` (identity forward, all-reduce backward)
    is applied to it unless `shared_input` says the caller already did so once for several
    layers reading the same tensor (attention's q, k and v). With sequence parallelism the
    input arrives split along the sequence and is all-gathered instead (backward:
    reduce-scatter). The output stays split unless `gather_output`.
    """

    tp_shard_dims = {"weight": 0, "bias": 0}

    def __init__(
        self,
        full: nn.Linear,
        group: CommGroup,
        *,
        gather_output: bool = False,
        shared_input: bool = False,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.group = group
        self.in_features = full.in_features
        self.full_out_features = full.out_features
        self.out_features = shard_size(full.out_features, group, "out_features")
        self.gather_output = gather_output
        self.shared_input = shared_input
        self.sequence_parallel = sequence_parallel
        self.weight = _slice(full.weight, 0, group)  # (C_out / tp, C_in)
        self.bias = _slice(full.bias, 0, group) if full.bias is not None else None
        self.sequence_parallel_params: tuple[str, ...] = ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shared_input:
            pass  # f or the sequence gather was applied once by the enclosing region
        elif self.sequence_parallel:
            x = regions.gather_sequence(x, self.group)  # (B, T/tp, C_in) -> (B, T, C_in)
        else:
            x = regions.f(x, self.group)
        y = F.linear(x, self.weight, self.bias)  # (B, T, C_out / tp)
        y = with_lora(self, x, y)  # LoRA: its B split like W (parallel/lora.py)
        return regions.gather_slices(y, self.group, dim=-1) if self.gather_output else y

    def extra_repr(self) -> str:
        return (
            f"tp_rank={self.group.rank}/{self.group.size}, in_features={self.in_features}, "
            f"out_features={self.out_features} of {self.full_out_features}, "
            f"bias={self.bias is not None}, gather_output={self.gather_output}, "
            f"sequence_parallel={self.sequence_parallel}"
            + (", shared_input=True" if self.shared_input else "")
        )


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W split by input features: each rank adds its partial product.

    The input is already split along its features (the column-parallel output), or split
    here when `input_is_parallel` is False. The partial outputs are summed by `g` (with
    sequence parallelism: reduce-scattered along the sequence); the bias is added once,
    after the sum, so it is not counted tp times.
    """

    tp_shard_dims = {"weight": 1}

    def __init__(
        self,
        full: nn.Linear,
        group: CommGroup,
        *,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.group = group
        self.full_in_features = full.in_features
        self.in_features = shard_size(full.in_features, group, "in_features")
        self.out_features = full.out_features
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.weight = _slice(full.weight, 1, group)  # (C_out, C_in / tp)
        self.bias = (
            nn.Parameter(full.bias.detach().clone(), requires_grad=full.bias.requires_grad)
            if full.bias is not None
            else None
        )
        # Under sequence parallelism the bias is added to local tokens only.
        self.sequence_parallel_params = (
            ("bias",) if sequence_parallel and self.bias is not None else ()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = regions.split(x, self.group, dim=-1)  # (B, T, C_in) -> (B, T, C_in / tp)
        partial = F.linear(x, self.weight)  # (B, T, C_out), this rank's share of the sum
        partial = with_lora(self, x, partial)  # LoRA: A split like W; B (A_r x_r) partial too
        if self.sequence_parallel:
            y = regions.reduce_scatter_sequence(partial, self.group)  # (B, T/tp, C_out)
        else:
            y = regions.g(partial, self.group)  # (B, T, C_out)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (
            f"tp_rank={self.group.rank}/{self.group.size}, "
            f"in_features={self.in_features} of {self.full_in_features}, "
            f"out_features={self.out_features}, bias={self.bias is not None}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class VocabParallelEmbedding(nn.Module):
    """An embedding table split by vocabulary rows: rank r holds ids [r V/tp, (r+1) V/tp).

    Each rank looks up the ids it owns and writes zeros for the others; summing over the
    ranks (`g`, or a reduce-scatter along the sequence with sequence parallelism) gives
    every token its row.
    """

    tp_shard_dims = {"weight": 0}

    def __init__(
        self, full: nn.Embedding, group: CommGroup, *, sequence_parallel: bool = False
    ) -> None:
        super().__init__()
        if full.padding_idx is not None or full.max_norm is not None or full.sparse:
            raise ValueError(
                "VocabParallelEmbedding supports plain embeddings only "
                f"(padding_idx={full.padding_idx}, max_norm={full.max_norm}, "
                f"sparse={full.sparse})"
            )
        self.group = group
        self.full_num_embeddings = full.num_embeddings
        self.num_embeddings = shard_size(full.num_embeddings, group, "vocabulary")
        self.embedding_dim = full.embedding_dim
        self.start = group.rank * self.num_embeddings  # first id this rank owns
        self.sequence_parallel = sequence_parallel
        self.weight = _slice(full.weight, 0, group)  # (V / tp, C)
        self.sequence_parallel_params: tuple[str, ...] = ()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start  # (B, T)
        foreign = (local < 0) | (local >= self.num_embeddings)
        rows = F.embedding(local.masked_fill(foreign, 0), self.weight)  # (B, T, C)
        partial = rows.masked_fill(foreign.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return regions.reduce_scatter_sequence(partial, self.group)  # (B, T/tp, C)
        return regions.g(partial, self.group)

    def extra_repr(self) -> str:
        end = self.start + self.num_embeddings
        return (
            f"tp_rank={self.group.rank}/{self.group.size}, "
            f"num_embeddings={self.num_embeddings} of {self.full_num_embeddings} "
            f"(ids {self.start}..{end - 1}), embedding_dim={self.embedding_dim}, "
            f"sequence_parallel={self.sequence_parallel}"
        )
