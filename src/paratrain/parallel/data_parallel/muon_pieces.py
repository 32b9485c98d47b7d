"""Which elements of ZeRO's flat shards Muon's optimizer treats how: the runs AdamW
updates, and every rank's piece of each Muon matrix (sharded_muon.py)."""

from __future__ import annotations

from collections.abc import Collection

from paratrain.parallel.data_parallel.flat_buffer import FlatShard, Piece, Segment

Run = tuple[int, int, int]  # (shard index, start, end) of AdamW's elements in a shard


def adamw_runs(shards: list[FlatShard], matrices: Collection[str]) -> list[Run]:
    """The stretches of each shard that AdamW updates: consecutive pieces of parameters
    that are not Muon's, merged (the padding at the end of the last shard is in none)."""
    runs: list[Run] = []
    for si, s in enumerate(shards):
        for p in s.layout.local_pieces(s.rank):
            if p.segment.name in matrices:
                continue
            a, b = p.shard_offset, p.shard_offset + p.numel
            if runs and runs[-1][0] == si and runs[-1][2] == a:
                runs[-1] = (si, runs[-1][1], b)
            else:
                runs.append((si, a, b))
    return runs


def pieces_by_rank(
    shards: list[FlatShard], matrices: list[tuple[int, Segment]], k: int
) -> list[dict[int, Piece]]:
    """For each of the k ranks, its piece of each matrix i (shard index, segment) it holds
    a piece of: every rank knows every rank's, so no sizes need exchanging."""
    pieces: list[dict[int, Piece]] = [{} for _ in range(k)]
    for q in range(k):
        held = [{p.segment.name: p for p in s.layout.local_pieces(q)} for s in shards]
        for i, (si, seg) in enumerate(matrices):
            if seg.name in held[si]:
                pieces[q][i] = held[si][seg.name]
    return pieces
