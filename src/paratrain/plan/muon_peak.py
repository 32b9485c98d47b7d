"""The peak of a Muon step on a rank that holds its matrices whole or split over tp
(parallel/data_parallel/muon.py `WholeMuon`, muon_exchange.py): the model state beside the
largest of the step's stages, chunk by chunk (each chunk's optimizer steps on its own).

Each stage's buffers go once the next stage has made its own (muon_exchange.py), so the
stages are counted apart, each with what is alive while it runs (bytes; ns the
Newton-Schulz precision's bytes per element, r x c a matrix, m = min(r, c)):
- AdamW's step on the other parameters, first: on the CPU foreach's sqrt(v), four bytes
  per element (rank_peak.py `update_peak_bytes`);
- Newton-Schulz on one matrix: the matrices not yet orthogonalized or their results, and
  its iterate, Gram matrix, polynomial and next iterate, ns (2 r c + 2 m^2);
- over tp, each all-to-all's send beside its receive, and the packing before it (the
  updates' float32 shards, Nesterov's copies among them; the results, their tp shards and
  the packed buffer, an upper bound: a shard cut along rows is a view);
- over dp, the all-gather of the replicas' (or owners') results: this rank's packed
  shards, the result and, for unequal pieces, gloo's padded send and receive, the longest
  piece once and k times (comm/padded.py).
None for ZeRO's flat buffers (their Muon is plan/muon_shards.py's, with no term here yet).
"""

from __future__ import annotations

from paratrain.plan.layout import Layout, Workload, flat_buffered
from paratrain.plan.model import ModelSpec
from paratrain.plan.muon import Matrix, chunk_matrices, momentum_elements, owners_of
from paratrain.plan.rank_groups import Coords, data_rank

F32 = 4


def muon_step_peak_bytes(
    model: ModelSpec,
    workload: Workload,
    layout: Layout,
    at: Coords,
    state: dict[str, int],
    device: str,
) -> float | None:
    """The rank's peak in its optimizer step under `--optimizer muon` (module docstring);
    `state`: its model state by kind, all of it alive there."""
    ns = workload.muon_ns_bytes
    if not ns or flat_buffered(workload, layout):
        return None
    momentum = momentum_elements(model, layout, at.stage)
    adam = (state["optimizer"] - F32 * momentum) // 8  # AdamW's two moments an element
    worst = float(F32 * adam if device == "cpu" else 0)
    k, t = layout.data_ranks, layout.tp
    me = data_rank(layout, at) * t + at.tp_rank  # owners are numbered d tp + t
    for matrices in chunk_matrices(model, layout, at.stage):
        owners = owners_of(matrices, k * t)
        stages = (
            _split(matrices, owners, me, k, t, ns) if t > 1 else _whole(matrices, owners, me, k, ns)
        )
        worst = max(worst, *stages)
    return state["total"] + worst


def _newton_schulz(m: Matrix, ns: int) -> int:
    rows, cols = m
    return ns * (2 * rows * cols + 2 * min(rows, cols) ** 2)


def _gather(held: list[int], own: int) -> int:
    """An all-gather over k ranks of pieces `held` (bytes), this rank's `own`: its packed
    send, the result and, for unequal pieces, the padded send and receive."""
    longest = max(held)
    padded = 0 if len(set(held)) == 1 else longest * (len(held) + 1)
    return own + sum(held) + padded


def _split(
    matrices: list[Matrix], owners: list[int], me: int, k: int, t: int, ns: int
) -> list[int]:
    """WholeMuon over tp: the stages of `_split_results`."""
    d = me // t
    ours = sum(r * c // t for (r, c), o in zip(matrices, owners, strict=True) if o // t == d)
    mine = [m for m, o in zip(matrices, owners, strict=True) if o == me]
    whole = sum(r * c for r, c in mine)
    stages = [
        2 * F32 * ours,  # the updates' shards and their packed send
        F32 * ours + F32 * whole,  # the first all-to-all
        2 * F32 * whole,  # its receive and the whole matrices cut from it
        max((F32 * whole + _newton_schulz(m, ns) for m in mine), default=0),
        3 * ns * whole,  # the results, their tp shards and the packed send
        ns * whole + ns * ours,  # the second all-to-all
    ]
    if k > 1:
        held = [0] * k  # each replica's shards of its results
        for (r, c), o in zip(matrices, owners, strict=True):
            held[o // t] += ns * r * c // t
        stages += [2 * held[d], _gather(held, held[d])]
    return stages


def _whole(matrices: list[Matrix], owners: list[int], me: int, k: int, ns: int) -> list[int]:
    """WholeMuon without tp: `_whole`'s results of the matrices this rank owns, then
    `_exchange`'s all-gather of every owner's."""
    mine = [m for m, o in zip(matrices, owners, strict=True) if o == me]
    own = sum(ns * r * c for r, c in mine)
    stages = [max((own + F32 * r * c + _newton_schulz((r, c), ns) for r, c in mine), default=0)]
    if k > 1:
        held = [0] * k
        for (r, c), o in zip(matrices, owners, strict=True):
            held[o] += ns * r * c
        stages.append(own + _gather(held, own))
    return stages
