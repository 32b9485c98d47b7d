"""Cross-entropy over vocabulary-split logits, without ever gathering them.

With the LM head column-parallel over the vocabulary, rank r holds logits z[:, V_r] for its
vocabulary slice V_r (Megatron-LM, arXiv:1909.08053, section 3: "fuse the output of the
parallel GEMM with the cross entropy loss"). For one token with target t:

    loss = log sum_v exp(z_v) - z_t
         = log sum_r sum_{v in V_r} exp(z_v - m) - (z_t - m),   m = max_v z_v

so three numbers per token cross the group, never V: the max m (all-reduce max), then the
local sums of exp(z - m) together with z_t - m, which only the rank owning t contributes
(one all-reduce sum over a (2, N) tensor). Subtracting the global max keeps exp() from
overflowing exactly as a single-device log-softmax does.

Backward needs no communication: dloss/dz_v = softmax_v - [v = t], and rank r has the
softmax of its own slice (exp(z - m) / sum, saved in forward), so it computes the
gradient of its logits alone. The saved tensor is (N, V/tp): the head's activation
memory is split too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from paratrain import comm
from paratrain.comm.group import CommGroup


class _VocabParallelCrossEntropy(torch.autograd.Function):
    # torch leaves Function.apply unannotated: forward's arguments.
    apply: ClassVar[Callable[[torch.Tensor, torch.Tensor, CommGroup, int], torch.Tensor]]

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        targets: torch.Tensor,
        group: CommGroup,
        ignore_index: int,
    ) -> torch.Tensor:
        z = logits.float()  # (N, V/tp); float32 statistics whatever the model dtype
        v_local = z.shape[-1]
        start = group.rank * v_local
        logits_max = z.detach().amax(dim=-1)  # (N,)
        comm.all_reduce(logits_max, group, op="max")
        shifted = z - logits_max.unsqueeze(-1)  # (N, V/tp), all <= 0 for the global max

        valid = targets != ignore_index  # (N,)
        local_t = targets - start
        mine = valid & (local_t >= 0) & (local_t < v_local)  # this rank owns the target
        local_t = local_t.masked_fill(~mine, 0)
        picked = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1)  # (N,)
        exp = shifted.exp_()  # (N, V/tp); shifted is not needed any more
        stats = torch.stack([exp.sum(dim=-1), picked.masked_fill(~mine, 0.0)])  # (2, N)
        comm.all_reduce(stats, group, op="sum")  # one message for both statistics
        sum_exp, target_shifted = stats[0], stats[1]

        per_token = (sum_exp.log() - target_shifted).masked_fill(~valid, 0.0)  # (N,)
        count = valid.sum()  # 0 tokens gives nan, as torch's cross-entropy does
        softmax = exp.div_(sum_exp.unsqueeze(-1))  # (N, V/tp), in place of exp
        ctx.save_for_backward(softmax, local_t, mine, valid, count)
        ctx.logits_dtype = logits.dtype
        return per_token.sum() / count

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, local_t, mine, valid, count = ctx.saved_tensors
        grad_z = softmax.clone()  # (N, V/tp): d loss_i / d z_iv = softmax_iv - [v = t_i]
        rows = torch.arange(grad_z.shape[0], device=grad_z.device)
        grad_z[rows, local_t] -= mine.to(grad_z.dtype)
        scale = valid.to(grad_z.dtype) * (grad / count)  # (N,): mean over valid tokens
        grad_z.mul_(scale.unsqueeze(-1))
        return grad_z.to(ctx.logits_dtype), None, None, None


class VocabParallelCrossEntropy(nn.Module):
    """Mean cross-entropy of (N, V/tp) vocabulary-split logits and (N,) full target ids.

    Equal on every tp rank; the same value as `nn.CrossEntropyLoss(ignore_index=...)` on
    the gathered (N, V) logits, up to float32 rounding of the sums.
    """

    def __init__(self, group: CommGroup, ignore_index: int = -100) -> None:
        super().__init__()
        self.group = group
        self.ignore_index = ignore_index

    @classmethod
    def from_loss(cls, full: nn.Module, group: CommGroup) -> VocabParallelCrossEntropy:
        """Replace a plain `nn.CrossEntropyLoss`, keeping its ignore_index."""
        if not isinstance(full, nn.CrossEntropyLoss):
            raise ValueError(f"vocab_loss replaces nn.CrossEntropyLoss, not {type(full).__name__}")
        if full.reduction != "mean" or full.weight is not None or full.label_smoothing:
            raise ValueError(
                "vocab_loss supports mean reduction without class weights or label "
                f"smoothing (got reduction={full.reduction!r}, "
                f"label_smoothing={full.label_smoothing})"
            )
        return cls(group, full.ignore_index)

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        targets = targets.reshape(-1)
        logits = logits.reshape(targets.shape[0], -1)  # (N, V/tp)
        return _VocabParallelCrossEntropy.apply(logits, targets, self.group, self.ignore_index)

    def extra_repr(self) -> str:
        return f"tp_rank={self.group.rank}/{self.group.size}, ignore_index={self.ignore_index}"
