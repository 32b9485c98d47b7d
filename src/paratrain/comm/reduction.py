"""Element-wise reductions: sum, avg, max, min, as our algorithms apply them and as the
backend's collectives are asked for them."""

from __future__ import annotations

import torch
import torch.distributed as dist

REDUCE_OPS = ("sum", "avg", "max", "min")
NATIVE_OPS = {  # the backend's reduction for each of ours
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,  # then divided by finish_avg_: defined for integers too
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


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


def combine_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, op: str) -> None:
    """out <- a (op) b in one pass (out may be neither)."""
    if op in ("sum", "avg"):
        torch.add(a, b, out=out)
    elif op == "max":
        torch.maximum(a, b, out=out)
    else:
        torch.minimum(a, b, out=out)


def finish_avg_(total: torch.Tensor, count: int) -> None:
    """Divide a sum by the group size. Integers are rounded down (floor), as `//` does."""
    if total.is_floating_point():
        total.div_(count)
    else:
        total.copy_(torch.div(total, count, rounding_mode="floor"))
