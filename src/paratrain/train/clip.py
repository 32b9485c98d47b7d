"""The global gradient norm, counting every parameter once, and clipping by it.

The norm must be global: clipping each stage (or shard) by its own norm would scale the
parts differently and change the update's direction. Each replica reports the squared
norms of the gradient entries it holds (`Replica.grad_squares`); they are summed in
float64 and reduced over exactly the groups that split each gradient:

- dp, where a wrapper shards the reduced gradient (ZeRO, FSDP): ranks hold disjoint
  pieces, so their squares add; replicas that hold the whole gradient add nothing;
- tp, for tensor-parallel shards (`sharded_parameters`); a parameter replicated on every
  tp rank (LayerNorm) counts once;
- pp, across stages, which hold different parameters (a weight tied across stages is
  left out on all but one of them by the caller).

The traffic is three tiny all-reduces at most: 16 bytes over dp, 8 over tp, 8 over pp.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from paratrain import comm
from paratrain.parallel.replica import GradSquares, Replica


def global_grad_norm(
    parts: Sequence[GradSquares],
    tp_split: Collection[str],
    tp: comm.CommGroup | None = None,
    pp: comm.CommGroup | None = None,
) -> float:
    """The L2 norm of the whole model's gradient, equal on every rank.

    parts: what each of this rank's replicas holds; tp_split: the names (as in the parts)
    of tensor-parallel shards.
    """
    # (tp-split, replicated) squares of dp-sharded entries, then of whole ones
    device = parts[0].squares.device  # where the gradients are
    sharded = torch.zeros(2, dtype=torch.float64, device=device)
    whole = torch.zeros(2, dtype=torch.float64, device=device)
    sharded_over = None
    for part in parts:
        split = [name in tp_split for name in part.names]
        split = torch.tensor(split, dtype=torch.bool, device=device)
        target = whole if part.sharded_over is None else sharded
        target[0] += part.squares[split].sum()
        target[1] += part.squares[~split].sum()
        sharded_over = part.sharded_over or sharded_over
    if sharded_over is not None:
        comm.all_reduce(sharded, sharded_over, op="sum")
    squares = sharded + whole
    if tp is not None and tp.size > 1:
        comm.all_reduce(squares[:1], tp, op="sum")
    total = squares.sum().reshape(1)
    if pp is not None and pp.size > 1:
        comm.all_reduce(total, pp, op="sum")
    return float(total.sqrt())


def clip_to(replicas: Sequence[Replica], norm: float, max_norm: float) -> None:
    """Scale every replica's gradient so the global norm is at most max_norm (0: no
    clipping), by torch.nn.utils.clip_grad_norm_'s rule: max_norm / (norm + 1e-6)."""
    if max_norm <= 0:
        return
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:  # False for a NaN norm: the step is skipped instead
        for r in replicas:
            r.scale_grads_(coef)
