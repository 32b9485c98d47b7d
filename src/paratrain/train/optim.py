"""AdamW with decoupled weight decay on matrices and embeddings, and the LR schedule."""

from __future__ import annotations

import math

import torch
from torch import nn


def learning_rate(step: int, base_lr: float, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup from 0 over `warmup` steps, then cosine decay to min_ratio * base_lr.

    `step` counts from 0; the first step uses base_lr / warmup (not 0), so no step is wasted.
    """
    if warmup and step < warmup:
        return base_lr * (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return base_lr * (min_ratio + (1.0 - min_ratio) * cosine)


def scaled_lr(base_lr: float, global_batch: int, base_batch: int, scaling: str) -> float:
    """The peak rate for a global batch, from a rate tuned at `base_batch` (seeds, 9.2.1).

    linear: lr * G / G0 (Goyal et al. 2017, arXiv:1706.02677), for SGD-like optimizers;
    sqrt: lr * sqrt(G / G0), which keeps the update's noise scale (Krizhevsky 2014,
    arXiv:1404.5997; Malladi et al. 2022 for Adam); none: lr unchanged.
    """
    ratio = global_batch / base_batch
    if scaling == "linear":
        return base_lr * ratio
    if scaling == "sqrt":
        return base_lr * math.sqrt(ratio)
    if scaling == "none":
        return base_lr
    raise ValueError(f"lr scaling {scaling!r}; valid: none, linear, sqrt")


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay 2-D weights (linear layers, embeddings); not biases or LayerNorm gains."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_adamw(
    model: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float]
) -> torch.optim.AdamW:
    # foreach=True is PyTorch's fast CPU/GPU path for many small tensors.
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=betas, foreach=True)
