"""Delay compensation for asynchronous SGD (DC-ASGD, Zheng et al. 2017, arXiv:1609.08326).

A gradient computed on parameters w_pulled, applied at w_now, is corrected with a
first-order Taylor term, the Hessian approximated by lambda * g * g:
    g_corrected = g + lambda * g * g * (w_now - w_pulled)
DC-ASGD-c keeps lambda constant; DC-ASGD-a divides it, per coordinate, by the root of a
moving average of g * g, so that one lambda0 suits coordinates whose gradients differ in
scale by orders of magnitude (the authors' implementation: microsoft/Delayed-Compensation-
Asynchronous-Stochastic-Gradient-Descent-for-Multiverso, dcasgda_updater.h).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paratrain.config import DC_MODES

DC_MEAN_SQUARE_EPS = 1e-7  # inside the root, as in the authors' updater (module docstring)


def dc_asgd_correct(
    grad: torch.Tensor, w_now: torch.Tensor, w_pulled: torch.Tensor, lam: float | torch.Tensor
) -> torch.Tensor:
    """g + lambda * g * g * (w_now - w_pulled); lambda = 0 leaves g unchanged.

    lam: a number (DC-ASGD-c) or one value per coordinate (DC-ASGD-a's lambda_t).
    """
    if not isinstance(lam, torch.Tensor) and lam == 0.0:
        return grad
    return grad + lam * grad * grad * (w_now - w_pulled)


def dc_mean_square(mean_square: torch.Tensor, grad: torch.Tensor, decay: float) -> torch.Tensor:
    """MeanSquare(t) = m * MeanSquare(t-1) + (1 - m) * g * g (arXiv:1609.08326, DC-ASGD-a)."""
    return decay * mean_square + (1.0 - decay) * grad * grad


def dc_adaptive_lambda(mean_square: torch.Tensor, lam0: float) -> torch.Tensor:
    """lambda_t = lambda0 / sqrt(MeanSquare(t)) per coordinate (arXiv:1609.08326, DC-ASGD-a).

    No bias correction of the zero start, as in the paper and the authors' updater: the
    first ~1 / (1 - m) updates get a larger lambda_t.
    """
    return lam0 / torch.sqrt(mean_square + DC_MEAN_SQUARE_EPS)


@dataclass
class DelayCompensation:
    """DC-ASGD as the server applies it: constant lambda, or DC-ASGD-a's lambda_t with the
    mean square of every applied gradient (one average for the server, as MeanSquare(t) is
    indexed by the server's update t; the authors' updater keeps one per worker). Adaptive
    costs the server one more flat copy of the parameters."""

    lam: float = 0.0
    mode: str = "constant"  # or "adaptive" (config.DC_MODES)
    decay: float = 0.95  # m of the mean square, adaptive only
    mean_square: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.mode not in DC_MODES:
            raise ValueError(f"DC-ASGD mode {self.mode!r}; valid: {', '.join(DC_MODES)}")

    def __call__(
        self, grad: torch.Tensor, w_now: torch.Tensor, w_pulled: torch.Tensor
    ) -> torch.Tensor:
        if self.lam == 0.0:
            return grad
        if self.mode == "constant":
            return dc_asgd_correct(grad, w_now, w_pulled, self.lam)
        if self.mean_square is None:
            self.mean_square = torch.zeros_like(grad)
        # This gradient enters the average before its own lambda_t, as in the updater.
        self.mean_square = dc_mean_square(self.mean_square, grad, self.decay)
        lam_t = dc_adaptive_lambda(self.mean_square, self.lam)
        return dc_asgd_correct(grad, w_now, w_pulled, lam_t)
