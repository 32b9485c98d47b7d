"""The router of a mixture of experts: scores, top-k choice, capacity and load balancing.

Plain arithmetic on tensors, no process group: the counts that make capacity and the
balancing statistics global (over every data shard of the batch) are handed in by the
caller (models/moe.py), which is what lets a single process be the oracle of any layout.
docs/experts.md derives every formula below.

- Top-k gating: each token goes to the k experts of highest score (Shazeer et al.,
  arXiv:1701.06538; k = 1 is Switch, Fedus et al., arXiv:2101.03961; k = 2 GShard,
  Lepikhin et al., arXiv:2006.16668).
- Capacity: each expert takes at most C = ceil(factor · k · T / E) of the T tokens' k·T
  assignments; in GShard's priority order (every first choice before any second choice,
  then by position in the batch), the rest are dropped.
- Auxiliary load-balancing loss, Switch eq. (4): α · E · Σ_i f_i · P_i.
- Auxiliary-loss-free balancing (DeepSeek-V3, arXiv:2412.19437, section 2.1.2): a bias
  per expert added to the scores for the choice only, moved by a fixed rate toward
  balance after each step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

SCORES = ("softmax", "sigmoid")


@dataclass
class Routing:
    """What the router decided for N tokens."""

    scores: torch.Tensor  # (N, E) affinities, softmax or sigmoid, differentiable
    experts: torch.Tensor  # (N, k) chosen experts, best first (int64)
    weights: torch.Tensor  # (N, k) gate weights of the chosen experts, differentiable


class Router(nn.Module):
    """Linear gate -> scores -> top-k experts and their weights.

    `bias` (E,) is DeepSeek-V3's balancing bias: added to the scores to choose the
    experts, never to the weights, so it steers load without entering the gradient.
    A buffer: updated by `balance_bias`, not by the optimizer, saved with the model.
    """

    bias: torch.Tensor  # a buffer (registered below): typed for the checker

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        top_k: int,
        score: str = "softmax",
        normalize: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if score not in SCORES:
            raise ValueError(f"router score {score!r}; valid: {', '.join(SCORES)}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k {top_k} must be between 1 and num_experts {num_experts}")
        self.top_k, self.score, self.normalize = top_k, score, normalize
        self.gate = nn.Linear(d_model, num_experts, bias=False, device=device)
        self.register_buffer("bias", torch.zeros(num_experts, device=device))

    def forward(self, x: torch.Tensor) -> Routing:
        logits = self.gate(x)  # (N, E)
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        # The bias only ranks; detached, so no gradient reaches it through the choice.
        experts = (scores.detach() + self.bias).topk(self.top_k, dim=-1).indices  # (N, k)
        weights = scores.gather(1, experts)  # (N, k)
        if self.normalize:  # the chosen weights sum to 1 (Mixtral, DeepSeek-V3)
            weights = weights / weights.sum(-1, keepdim=True)
        return Routing(scores, experts, weights)


def capacity(tokens: int, num_experts: int, top_k: int, factor: float | None) -> int | None:
    """Assignments one expert may take, over the whole batch; None: no limit."""
    if factor is None:
        return None
    return math.ceil(factor * top_k * tokens / num_experts)


def slot_counts(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(k, E): how many tokens chose expert e as their j-th choice."""
    return F.one_hot(experts, num_experts).sum(0)  # (N, k, E) -> (k, E)


def queue_positions(
    experts: torch.Tensor, before: torch.Tensor, total: torch.Tensor
) -> torch.Tensor:
    """(N, k): each assignment's place in its expert's queue over the whole batch.

    Priority is GShard's: every first choice (slot 0) of the batch before any second
    choice, and within a slot the batch order. `before` (k, E) counts the slot's
    assignments of the shards ahead of this one, `total` (k, E) those of every shard.
    """
    num_experts = total.shape[1]
    onehot = F.one_hot(experts, num_experts)  # (N, k, E)
    ahead_here = onehot.cumsum(0) - onehot  # earlier tokens of this shard, same slot
    earlier_slots = total.cumsum(0) - total  # (k, E): all of slots 0 .. j-1
    place = ahead_here + (earlier_slots + before).unsqueeze(0)  # (N, k, E)
    return (place * onehot).sum(-1)  # (N, k): the chosen expert's entry


def load_balancing_loss(
    scores: torch.Tensor, load: torch.Tensor, tokens: int, top_k: int, shards: int, coef: float
) -> torch.Tensor:
    """This shard's part of Switch's α · E · Σ_i f_i · P_i (arXiv:2101.03961, eq. 4-6).

    f_i = load_i / (k · T): the fraction of the batch's k·T assignments that chose
    expert i (before capacity; a count, no gradient); for k = 1 exactly Switch's f_i.
    P_i = (1/T) Σ_x p_i(x): the mean probability, p the scores normalised over experts
    (softmax scores already are). Both over the whole batch of T tokens; P is a sum over
    tokens, so each of the `shards` shards adds its own tokens' part, scaled by `shards`
    so that the mean over shards (what data parallelism averages) is the batch's loss.
    """
    num_experts = scores.shape[1]
    probs = scores / scores.sum(-1, keepdim=True)  # (N, E)
    f = load.to(scores.dtype) / (top_k * tokens)  # (E,)
    p_part = probs.sum(0) * (shards / tokens)  # (E,): this shard's tokens only
    return coef * num_experts * (f * p_part).sum()


@torch.no_grad()
def balance_bias(bias: torch.Tensor, load: torch.Tensor, rate: float) -> None:
    """DeepSeek-V3's update, in place: b_i += γ · sign(mean load - load_i).

    An overloaded expert's bias falls by γ, an underloaded one's rises by γ, one exactly
    at the mean stays (arXiv:2412.19437, section 2.1.2, "bias update speed" γ).
    """
    load = load.to(bias.dtype)
    bias.add_(rate * torch.sign(load.mean() - load))
