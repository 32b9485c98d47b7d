"""--compress powersgd on each rank (parallel/data_parallel/powersgd.py): the matrices of
each chunk it holds, and what they cost, for our GPT and Llama (not a mixture of experts
or LoRA's adapters: their prediction says so in a note).

A chunk's matrices, on one tp rank: each block's (plan/muon.py `block_matrices`, (out,
in)), column-parallel ones (q, k, v, fc; Llama's gate and up) with out / t rows and
row-parallel ones (attention's output, the MLP's last) with in / t columns; the first
virtual stage's token table (V / t, h) and GPT's positions (T_max, h); the last's head
(V / t, h), unless it is the token table held on the same chunk (tied). PowerSGD
approximates those whose smaller side exceeds the rank r; a wrapper's bucket (one per
chunk) sends two float32 ring all-reduces: P's (rows x r each) beside every other element,
exactly, then Q's (cols x r each), and keeps Q (cols x r) as state.
"""

from __future__ import annotations

from paratrain.plan import comm
from paratrain.plan.layout import Layout
from paratrain.plan.model import ModelSpec
from paratrain.plan.muon import Matrix, block_matrices
from paratrain.plan.pipeline import stage_virtual_stages, virtual_stage_layers

FACTOR_BYTES = 4  # float32
# which of a block's matrices tensor parallelism splits by rows (True) or columns (False)
COLUMN_PARALLEL = {
    "gpt": (True, True, True, False, True, False),
    "llama": (True, True, True, False, True, True, False),
}


def local_matrices(model: ModelSpec, layout: Layout, stage: int) -> list[list[Matrix]]:
    """Per chunk on `stage`, the (rows, cols) of its parameters of two dimensions."""
    shape, t, s, c = model.shape, layout.tp, layout.pp, layout.chunks
    h, v = shape.d_model, shape.vocab_size
    block = [
        (rows // t, cols) if column else (rows, cols // t)
        for (rows, cols), column in zip(
            block_matrices(shape), COLUMN_PARALLEL[shape.arch], strict=True
        )
    ]
    layers = virtual_stage_layers(shape.n_layer, s, c)
    out = []
    for vs in stage_virtual_stages(stage, s, c):
        first, last = vs == 0, vs == s * c - 1
        mats = block * layers[vs]
        if first:
            mats = [(v // t, h)] + ([(shape.max_seq_len, h)] if shape.arch == "gpt" else []) + mats
        if last and not (first and model.tie_embeddings):
            mats = mats + [(v // t, h)]
        out.append(mats)
    return out


def compressed(matrices: list[Matrix], rank: int) -> list[Matrix]:
    return [m for m in matrices if min(m) > rank]


def powersgd_bytes(numel: int, matrices: list[Matrix], rank: int, k: int, at: int) -> int:
    """What rank `at` of k sends for a bucket of `numel` elements holding `matrices`."""
    mats = compressed(matrices, rank)
    first = numel - sum(a * b for a, b in mats) + sum(a * rank for a, _ in mats)
    sent = comm.ring_all_reduce_rank_bytes(first, FACTOR_BYTES, k, at)
    if mats:
        sent += comm.ring_all_reduce_rank_bytes(sum(b * rank for _, b in mats), FACTOR_BYTES, k, at)
    return sent


def factor_bytes(matrices: list[Matrix], rank: int) -> int:
    """Each approximated matrix's Q, the next step's warm start."""
    return FACTOR_BYTES * rank * sum(b for _, b in compressed(matrices, rank))


def powersgd_flops(model: ModelSpec, layout: Layout, rank: int, stage: int, reductions: int) -> int:
    """The products a rank on `stage` runs per step for PowerSGD, as FlopCounterMode counts
    them: per approximated matrix (n, m) M Q, M^T P and P Q^T, 2 n m r each, at each of
    the step's `reductions` (the QR has no count of its own)."""
    mats = [m for chunk in local_matrices(model, layout, stage) for m in compressed(chunk, rank)]
    return reductions * sum(6 * a * b * rank for a, b in mats)
