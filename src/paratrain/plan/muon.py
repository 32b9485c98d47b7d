"""Muon's costs, written once: the hidden matrices of a block, which rank orthogonalizes
each (the runtime, parallel/data_parallel/muon.py, takes its owners from here), and what a
rank holds and sends for them.

Under `--optimizer muon` with whole parameters (data parallelism, pipelines, context
parallelism) every rank of a replica's gradient group (dp_cp) keeps one momentum buffer
per matrix instead of AdamW's two moments, and each step all-gathers the owners'
orthogonalized matrices in the Newton-Schulz precision (2 bytes in bfloat16, 4 in float32):
a ring all-gather of chunks of unequal size, one per owner, in which rank r sends every
chunk but that of rank r + 1 (comm/traffic.py's `ring_all_gather`).

With a mixture of experts every block's MLP is one (models/moe.py): its router, stacked
experts and shared expert stay with AdamW, so a block's matrices are attention's alone.
`moe` below: the parameters of each block's mixture of experts in the wrapper counted
(plan/rank_experts.py `dense_moe`); 0 for a dense MLP.
"""

from __future__ import annotations

from paratrain.models.presets import ffn_width, kv_heads
from paratrain.plan.layout import Layout
from paratrain.plan.model import ModelSpec, Shape
from paratrain.plan.pipeline import stage_virtual_stages, virtual_stage_layers

Matrix = tuple[int, int]  # (rows, cols): (out_features, in_features) of a linear layer


def block_matrices(shape: Shape, moe: bool = False) -> list[Matrix]:
    """One block's Muon matrices, in the order the model's named_parameters gives them
    (models/plans.py `muon_matrices`): GPT's q, k, v, proj, fc, proj; Llama's q, k, v, o,
    gate, up, down. With a mixture of experts (`moe`) attention's four."""
    h, f = shape.d_model, ffn_width(shape)
    if shape.arch == "gpt":
        matrices = [(h, h)] * 4 + [(f, h), (h, f)]
    else:
        d_kv = kv_heads(shape) * (h // shape.n_head)
        matrices = [(h, h), (d_kv, h), (d_kv, h), (h, h), (f, h), (f, h), (h, f)]
    return matrices[:4] if moe else matrices


def iteration_flops(matrix: Matrix) -> int:
    """Multiply-adds of one Newton-Schulz iteration on an (m, n) matrix, m <= n after
    orientation: the Gram matrix (m^2 n), its square (m^3), the product with x (m^2 n)."""
    m, n = sorted(matrix)
    return 2 * m * m * n + m**3


def balanced_owners(costs: list[int], ranks: int) -> list[int]:
    """The rank that orthogonalizes each matrix: largest first, each to the rank with the
    least work so far (ties to the lower rank), so every rank computes the same answer and
    the most loaded rank carries at most the average plus one matrix."""
    load = [0] * ranks
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += costs[i]
    return owners


def owners_among(costs: list[int], held: list[dict[int, int]], ranks: int) -> list[int]:
    """Owners when the matrices are in pieces on several ranks (ZeRO's shards): largest
    first, each to the least loaded rank among those that hold a piece of it (ties: the
    one holding the most of it, then the lower rank). A matrix inside one rank's shard is
    that rank's, so it never travels; one that straddles goes to a holder.

    held[i]: {rank: elements of matrix i that rank holds}."""
    load = [0] * ranks
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(held[i], key=lambda r: (load[r], -held[i][r], r))
        owners[i] = rank
        load[rank] += costs[i]
    return owners


def owners_over_tp(owners: list[int], costs: list[int], ranks: int, tp: int) -> list[int]:
    """Matrices split over tp whose pieces meet at `owners` (of `ranks` dp ranks): the
    owners at one dp place, one per tp rank, share that place's matrices, balanced by
    cost. Numbered d tp + t (parallel/data_parallel/muon_exchange.py)."""
    out = [0] * len(owners)
    for d in range(ranks):
        owned = [i for i, o in enumerate(owners) if o == d]
        for i, t in zip(owned, balanced_owners([costs[i] for i in owned], tp), strict=True):
            out[i] = d * tp + t
    return out


def owners_of(matrices: list[Matrix], ranks: int) -> list[int]:
    """`balanced_owners` by the iteration's cost (the number of iterations scales every
    matrix alike, so it changes no owner)."""
    return balanced_owners([iteration_flops(m) for m in matrices], ranks)


def chunk_matrices(
    model: ModelSpec, layout: Layout, stage: int, moe: int = 0
) -> list[list[Matrix]]:
    """The Muon matrices of each chunk on `stage` (each chunk has its own optimizer)."""
    s, c = layout.pp, layout.chunks
    layers = virtual_stage_layers(model.shape.n_layer, s, c)
    per_block = block_matrices(model.shape, bool(moe))
    return [per_block * layers[vs] for vs in stage_virtual_stages(stage, s, c)]


def momentum_elements(model: ModelSpec, layout: Layout, stage: int, moe: int = 0) -> int:
    """Elements of Muon's momentum on a rank of `stage`: one per element of its shard of
    each matrix (every plan's Muon matrices are split over tp)."""
    whole = sum(r * c for chunk in chunk_matrices(model, layout, stage, moe) for r, c in chunk)
    return whole // layout.tp


def gather_bytes(
    model: ModelSpec, layout: Layout, stage: int, rank: int, ns_bytes: int, moe: int = 0
) -> int:
    """What rank `rank` of the gradient group (dp_cp) sends per step in the all-gathers of
    the results (one per chunk): each replica's shards of the results its ranks own, a ring
    all-gather of unequal chunks. Owners are numbered d tp + t (parallel/data_parallel/
    muon_exchange.py)."""
    k, t = layout.data_ranks, layout.tp
    if k == 1:
        return 0
    sent = 0
    for matrices in chunk_matrices(model, layout, stage, moe):
        held = [0] * k  # bytes of each replica's shards of the results
        for (r, c), owner in zip(matrices, owners_of(matrices, k * t), strict=True):
            held[owner // t] += r * c // t * ns_bytes
        sent += sum(held) - held[(rank + 1) % k]
    return sent


def tp_exchange_bytes(shard: int, owner_t: int, tp_rank: int, tp: int, ns_bytes: int) -> int:
    """What tp rank `tp_rank` sends for one matrix of `shard` elements per tp rank that tp
    rank `owner_t` puts together: its float32 shard of the update, or, on the owner, every
    other tp rank's shard of the result in the Newton-Schulz precision."""
    return 4 * shard if owner_t != tp_rank else (tp - 1) * shard * ns_bytes


def tp_bytes(
    model: ModelSpec,
    layout: Layout,
    stage: int,
    dp_rank: int,
    tp_rank: int,
    ns_bytes: int,
    moe: int = 0,
) -> int:
    """What a rank sends over tp per step: its float32 shards of the updates of the matrices
    its replica's other tp ranks own, and, for each matrix it owns, every other tp rank's
    shard of the result in the Newton-Schulz precision (two all-to-alls per chunk)."""
    t = layout.tp
    if t == 1:
        return 0
    sent = 0
    for matrices in chunk_matrices(model, layout, stage, moe):
        for (r, c), owner in zip(matrices, owners_of(matrices, layout.data_ranks * t), strict=True):
            d, owner_t = divmod(owner, t)
            if d != dp_rank:
                continue
            sent += tp_exchange_bytes(r * c // t, owner_t, tp_rank, t, ns_bytes)
    return sent
