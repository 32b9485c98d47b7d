"""The global gradient norm, counting every parameter once, and clipping by it.

The norm must be global: clipping each stage (or shard) by its own norm would scale the
parts differently and change the update's direction. Each replica reports the squared
norms of the gradient entries it holds (`Replica.grad_squares`); they are summed in
float64 and reduced over exactly the groups that split each gradient:

- dp, where a wrapper shards the reduced gradient (ZeRO, FSDP): ranks hold disjoint
  pieces, so their squares add; replicas that hold the whole gradient add nothing;
- ep, for experts split by expert parallelism (`GradSquares.split_over`): each rank of an
  ep group holds other experts, so each expert's gradient counts once;
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
from paratrain.parallel.data_parallel.replica import GradSquares, ScalesGradients


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
    device = parts[0].squares.device  # where the gradients are
    # (tp-split, replicated) squares, summed per list of groups whose ranks hold disjoint
    # entries (dp for sharded wrappers; ep for experts; none for whole replicas)
    sums: list[tuple[list[comm.CommGroup], torch.Tensor]] = []
    for part in parts:
        # Positions, not a boolean mask: the same elements in the same order (the same
        # sums), and a result size known without reading the mask, as fake tensors need.
        split = [name in tp_split for name in part.names]
        groups = [g for g in (part.sharded_over, part.split_over) if g is not None and g.size > 1]
        target = next((t for gs, t in sums if _same(gs, groups)), None)
        if target is None:
            target = torch.zeros(2, dtype=torch.float64, device=device)
            sums.append((groups, target))
        if all(split) or not any(split):  # one side: the same sum, without picking entries
            target[0 if split and split[0] else 1] += part.squares.sum()
            continue
        on, off = (
            torch.tensor(
                [i for i, s in enumerate(split) if s == side], dtype=torch.long, device=device
            )
            for side in (True, False)
        )
        target[0] += part.squares[on].sum()
        target[1] += part.squares[off].sum()
    for groups, target in sums:  # the same list on every rank: the same calls
        for group in groups:
            comm.all_reduce(target, group, op="sum")
    squares = torch.stack([t for _, t in sums]).sum(0)
    if tp is not None and tp.size > 1:
        comm.all_reduce(squares[:1], tp, op="sum")
    total = squares.sum().reshape(1)
    if pp is not None and pp.size > 1:
        comm.all_reduce(total, pp, op="sum")
    return float(total.sqrt())


def _same(a: list[comm.CommGroup], b: list[comm.CommGroup]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


def clip_coefficient(norm: float, max_norm: float) -> float:
    """The factor that brings the global norm to at most max_norm (0: no clipping), by
    torch.nn.utils.clip_grad_norm_'s rule: max_norm / (norm + 1e-6), never above 1."""
    if max_norm <= 0:
        return 1.0
    coef = max_norm / (norm + 1e-6)
    return coef if coef < 1.0 else 1.0  # 1.0 for a NaN norm: the step is skipped instead


def clip_to(replicas: Sequence[ScalesGradients], norm: float, max_norm: float) -> None:
    """Scale every replica's gradient so the global norm is at most max_norm."""
    coef = clip_coefficient(norm, max_norm)
    if coef != 1.0:
        for r in replicas:
            r.scale_grads_(coef)
