"""Element-wise reductions as our own algorithms apply them: sum, avg, max, min."""

from __future__ import annotations

import torch

REDUCE_OPS = ("sum", "avg", "max", "min")


def check_op(op: str) -> None:
    if op not in REDUCE_OPS:
        raise ValueError(f"reduce op {op!r}; valid: {', '.join(REDUCE_OPS)}")


def combine_(acc: torch.Tensor, incoming: torch.Tensor, op: str) -> None:
    """acc <- acc (op) incoming, in acc's dtype (as NCCL does: bf16 sums stay in bf16)."""
    if op in ("sum", "avg"):
        acc.add_(incoming)
    elif op == "max":
        torch.maximum(acc, incoming, out=acc)
    else:
        torch.minimum(acc, incoming, out=acc)


def finish_avg_(total: torch.Tensor, count: int) -> None:
    """Divide a sum by the group size. Integers are rounded down (floor), as `//` does."""
    if total.is_floating_point():
        total.div_(count)
    else:
        total.copy_(torch.div(total, count, rounding_mode="floor"))
