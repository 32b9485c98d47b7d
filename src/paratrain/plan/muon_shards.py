"""Muon over ZeRO's flat shards, per rank: which pieces of which matrices each rank holds,
who orthogonalizes each matrix, and what that sends and keeps (the runtime:
parallel/data_parallel/sharded_muon.py, which takes its owners from plan/muon.py).

A chunk's flat buffers list its parameters as the wrappers do: ZeRO-1/2 one buffer in
reverse order of registration, ZeRO-3 one per unit in module order (the tied token
table a root unit first). A buffer of n elements is cut into k shards of ceil(n / k);
a matrix's piece on rank q is its overlap with shard q. Per step and chunk:
- over the shard group (dp, or under HSDP a replica group), two all-to-alls: every
  piece of a matrix owned elsewhere goes to its owner in float32, and each owner sends
  every other holder its piece of the result in the Newton-Schulz precision;
- over tp, for the matrices a rank's dp place owns: its float32 tp shard to the tp rank
  that puts the matrix together, or, on that tp rank, every other tp rank's shard of
  the result (muon_exchange.py);
- state: Muon's momentum for each piece it holds, AdamW's two moments for the rest of
  its shards (the padding has neither).
With a mixture of experts (`moe`: plan/muon.py) a block's MLP is its MoE's parameters in
the wrapper, whole on every tp rank and all AdamW's; the experts' own wrapper under
ep > 1 holds no matrix (plan/rank_experts.py counts it).
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.models.presets import ffn_width
from paratrain.plan.layout import Layout
from paratrain.plan.model import ModelSpec
from paratrain.plan.muon import (
    Matrix,
    block_matrices,
    iteration_flops,
    owners_among,
    owners_over_tp,
    tp_exchange_bytes,
)
from paratrain.plan.pipeline import stage_virtual_stages, virtual_stage_layers

# (elements on one tp rank, the whole matrix when it is Muon's)
Segment = tuple[int, Matrix | None]


def block_segments(model: ModelSpec, tp: int, moe: int = 0) -> list[Segment]:
    """One block's parameters in registration order (models/gpt.py, models/llama.py) on
    one tp rank: column-parallel weights and biases split, row-parallel weights split and
    their biases replicated, norms replicated (models/plans.py); a mixture of experts
    whole (`moe` parameters: router, experts, shared expert, in that order)."""
    shape = model.shape
    h, t, m = shape.d_model, tp, block_matrices(shape)
    if model.arch == "gpt":
        f = ffn_width(shape)
        attn: list[Segment] = []
        for matrix in m[:3]:  # q, k, v with their biases
            attn += [(matrix[0] * matrix[1] // t, matrix), (matrix[0] // t, None)]
        norm = [(h, None), (h, None)]
        mlp: list[Segment] = [(f * h // t, m[4]), (f // t, None), (h * f // t, m[5]), (h, None)]
        attn = [*norm, *attn, (h * h // t, m[3]), (h, None), *norm]
    else:
        split: list[Segment] = [(r * c // t, (r, c)) for r, c in m]
        attn, mlp = [(h, None), *split[:4], (h, None)], split[4:]
    return [*attn, *([(moe, None)] if moe else mlp)]


def chunk_units(model: ModelSpec, layout: Layout, vs: int, moe: int = 0) -> list[list[Segment]]:
    """Virtual stage `vs`'s parameters by FSDP unit (models/plans.py `fsdp_units`), each
    in registration order: the ends' and one per block; with tied embeddings and both
    ends here, the token table alone first (a root unit) and no head."""
    shape, t = model.shape, layout.tp
    h, v = shape.d_model, shape.vocab_size
    first, last = vs == 0, vs == layout.pp * layout.chunks - 1
    tied = model.tie_embeddings and first and last
    layers = virtual_stage_layers(shape.n_layer, layout.pp, layout.chunks)[vs]
    table: Segment = (v * h // t, None)
    norm = [(h, None), (h, None)] if model.arch == "gpt" else [(h, None)]
    opening = [table] if first and not tied else []
    if first and model.arch == "gpt":
        opening.append(((shape.max_seq_len or 0) * h, None))
    closing = [*norm, *([] if tied else [table])] if last else []
    units = [[table]] if tied else []
    units += [opening, *[block_segments(model, t, moe)] * layers, closing]
    return [u for u in units if u]


def stage_buffers(
    model: ModelSpec, layout: Layout, stage: int, moe: int = 0
) -> list[list[list[Segment]]]:
    """Per chunk on `stage`, its flat buffers' segments in buffer order (module docstring)."""
    out = []
    for vs in stage_virtual_stages(stage, layout.pp, layout.chunks):
        units = chunk_units(model, layout, vs, moe)
        if layout.zero >= 3:
            out.append(units)
        else:
            out.append([[s for u in units for s in u][::-1]])
    return out


@dataclass(frozen=True)
class ChunkMuon:
    """One chunk's Muon over k shards: every matrix's whole shape, its pieces per rank,
    its owner over dp and, under tp, its owner numbered d tp + t."""

    shapes: list[Matrix]
    pieces: list[dict[int, int]]  # [matrix] {rank: elements of it that rank holds}
    owners: list[int]
    tp_owners: list[int]
    adamw: list[int]  # per rank: elements of its shards that AdamW updates

    @classmethod
    def of(cls, buffers: list[list[Segment]], k: int, tp: int) -> ChunkMuon:
        shapes: list[Matrix] = []
        pieces: list[dict[int, int]] = []
        adamw = [0] * k
        for segments in buffers:
            n = sum(numel for numel, _ in segments)
            shard = -(-n // k)
            offset = 0
            for numel, matrix in segments:
                held = {
                    q: min(offset + numel, (q + 1) * shard) - max(offset, q * shard)
                    for q in range(k)
                }
                held = {q: e for q, e in held.items() if e > 0}
                if matrix is None:
                    for q, e in held.items():
                        adamw[q] += e
                else:
                    shapes.append(matrix)
                    pieces.append(held)
                offset += numel
        costs = [iteration_flops(m) for m in shapes]
        owners = owners_among(costs, pieces, k)
        return cls(shapes, pieces, owners, owners_over_tp(owners, costs, k, tp), adamw)

    def dp_bytes(self, me: int, ns_bytes: int) -> int:
        """What rank `me` sends in the two all-to-alls over the shard group."""
        sent = 0
        for held, owner in zip(self.pieces, self.owners, strict=True):
            if owner != me and me in held:
                sent += 4 * held[me]
            elif owner == me:
                sent += ns_bytes * sum(e for q, e in held.items() if q != me)
        return sent

    def tp_bytes(self, me: int, tp_rank: int, tp: int, ns_bytes: int) -> int:
        """What rank `me` at tp rank `tp_rank` sends over tp for the matrices it owns."""
        sent = 0
        for (r, c), owner, numbered in zip(self.shapes, self.owners, self.tp_owners, strict=True):
            if owner != me:
                continue
            sent += tp_exchange_bytes(r * c // tp, numbered % tp, tp_rank, tp, ns_bytes)
        return sent

    def momentum(self, me: int) -> int:
        return sum(held.get(me, 0) for held in self.pieces)


def unpadded_elements(buffers: list[int], k: int, me: int) -> int:
    """Elements of flat buffers of these sizes in shard `me` of k, without the padding:
    what Muon's AdamW keeps moments for in a wrapper with no matrix (the experts')."""
    return sum(max(0, min(n, (me + 1) * -(-n // k)) - me * -(-n // k)) for n in buffers)


def stage_muons(model: ModelSpec, layout: Layout, stage: int, moe: int = 0) -> list[ChunkMuon]:
    """The Muon of each chunk on `stage` (each chunk is wrapped and optimized on its own);
    stage 0 holds one unsharded buffer (k = 1)."""
    k = layout.shard_ranks if layout.zero else 1
    return [ChunkMuon.of(b, k, layout.tp) for b in stage_buffers(model, layout, stage, moe)]


def optimizer_elements(model: ModelSpec, layout: Layout, stage: int, me: int, moe: int = 0) -> int:
    """Elements of optimizer state on shard rank `me`: two moments per AdamW element, one
    momentum per element of a matrix's piece."""
    chunks = stage_muons(model, layout, stage, moe)
    return sum(2 * c.adamw[me] + c.momentum(me) for c in chunks)
