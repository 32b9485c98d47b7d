"""Muon's arithmetic, pure: the Newton-Schulz orthogonalization and the learning-rate
adjustment by shape (which rank orthogonalizes which matrix is the planner's:
plan/muon.py).

Muon (Jordan et al. 2024; Liu et al. 2025, "Muon is Scalable for LLM Training",
arXiv:2502.16982) keeps a momentum buffer per hidden matrix and steps along its
orthogonalized version O = NS(M) ~ U V^T (M = U S V^T). The arithmetic below is
torch.optim.Muon's (torch/optim/_muon.py, the same from torch 2.11 to 2.14), operation for
operation and in the same layouts, so that a matrix updated here is bitwise the one
torch.optim.Muon gives from the same gradient: the iteration runs in bfloat16, on the
wide orientation (a tall matrix is transposed first and back at the end).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's quintic (a, b, c)
NS_EPS = 1e-7  # torch.optim.Muon's floor on the norm before the iteration
LR_ADJUSTS = ("original", "match-rms-adamw")  # config.choices.MUON_LR_ADJUSTS


@dataclass(frozen=True)
class MuonSettings:
    """Muon's hyperparameters (torch.optim.Muon's names) and the plan's matrices."""

    matrices: tuple[str, ...]  # module-name patterns: each module's `weight` is Muon's
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    lr_adjust: str = "match-rms-adamw"
    ns_dtype: torch.dtype = torch.bfloat16  # torch.optim.Muon's; float32 to compare orders


def tall(shape: torch.Size | tuple[int, ...]) -> bool:
    """Whether the iteration runs on the transpose: more rows than columns."""
    return shape[0] > shape[1]


def orthogonalize_wide(
    update: torch.Tensor, steps: int, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """NS_steps(update) in the wide orientation, in `dtype` (torch.optim.Muon's: bfloat16),
    contiguous: for a tall matrix the transpose of the result (`as_update` turns it back
    into the matrix's shape).

    In bfloat16 (8 significant bits) an input that differs in its last float32 bit, as
    gradients averaged in another order do, can round differently and the iteration carries
    that on: runs that sum in different orders agree to about 1e-3 of an update, not to
    float32 rounding. float32 keeps them within float32 rounding of each other."""
    a, b, c = NS_COEFFICIENTS
    x = update.to(dtype)
    if tall(update.shape):
        x = x.T
    x.div_(x.norm().clamp(min=NS_EPS))
    for _ in range(steps):
        gram = x @ x.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, gram_update, x, beta=a)
    return x


def as_update(wide: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """The orthogonalized update in the matrix's shape, with the strides torch.optim.Muon's
    has (a transposed view for a tall matrix), so the parameter update runs the same kernel."""
    return wide.T if tall(shape) else wide


def newton_schulz(
    update: torch.Tensor, steps: int, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """torch.optim.Muon's `_zeropower_via_newtonschulz` with its default coefficients."""
    return as_update(orthogonalize_wide(update, steps, dtype), update.shape)


def adjusted_lr(lr: float, shape: torch.Size | tuple[int, ...], how: str) -> float:
    """The matrix's rate: `original` (Jordan) scales by sqrt(max(1, rows / cols));
    `match-rms-adamw` (Liu et al., section 2.2) by 0.2 sqrt(max(rows, cols)), which gives
    the update AdamW's RMS, so AdamW's learning rate and weight decay carry over."""
    rows, cols = shape[0], shape[1]
    if how == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if how == "match-rms-adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"Muon lr adjustment {how!r}; valid: {', '.join(LR_ADJUSTS)}")
