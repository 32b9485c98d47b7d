"""Bytes on the wire: what our algorithms actually send equals what theory says, to the byte.

Ring all-reduce: each rank sends 2 (k-1) S / k bytes when k divides S; otherwise it sends
every chunk but one in each phase, with chunks as torch.tensor_split cuts them. Tree
all-reduce: the binomial structure, derived here independently of the implementation (a
rank's parent is itself with its lowest set bit cleared). Native collectives are recorded
with the same formulas (the backend does not report bytes).
"""

from __future__ import annotations

import pytest
import torch

from paratrain import comm
from paratrain.comm.traffic import chunk_sizes
from paratrain.mesh import Mesh
from tests.distributed import run_distributed


def test_chunk_sizes_follow_tensor_split():
    for numel in (0, 1, 7, 13, 1000):
        for k in range(1, 9):
            split = [len(c) for c in torch.arange(numel).tensor_split(k)]
            assert chunk_sizes(numel, k) == split


def binomial_parent(v: int) -> int | None:
    return None if v == 0 else v & (v - 1)  # clear the lowest set bit


def expected_tree_all_reduce_sent(nbytes: int, k: int, v: int) -> int:
    children = sum(1 for w in range(k) if binomial_parent(w) == v)
    up = nbytes if v != 0 else 0  # reduction: every non-root sends its partial sum once
    return up + children * nbytes  # broadcast: the result to each child


def sent_by_algorithm(rank, world_size, numel, dtype):
    mesh = Mesh.build(dp=world_size)
    group = mesh.group("dp")
    sent = {}
    for algo in ("ring", "tree", "native"):
        mesh.ledger.reset()
        comm.all_reduce(torch.ones(numel, dtype=dtype), group, algo=algo)
        sent[algo] = mesh.ledger.bytes_sent(op="all_reduce")
    for algo in ("ring", "native"):
        mesh.ledger.reset()
        comm.reduce_scatter(torch.ones(numel, dtype=dtype), group, algo=algo)
        sent["rs_" + algo] = mesh.ledger.bytes_sent(op="reduce_scatter")
        mesh.ledger.reset()
        comm.all_gather_flat(
            torch.ones(numel // world_size, dtype=dtype),
            group,
            algo=algo,
            sizes=[numel // world_size] * world_size,
        )
        sent["ag_" + algo] = mesh.ledger.bytes_sent(op="all_gather")
    return sent


@pytest.mark.parametrize("k", [2, 3, 4, 8])
@pytest.mark.parametrize("numel", [960, 1001])
def test_ring_and_tree_send_what_theory_says(k, numel):
    dtype = torch.float32
    results = run_distributed(sent_by_algorithm, k, numel, dtype)
    size = 4 * numel
    chunks = [4 * n for n in chunk_sizes(numel, k)]
    for rank, sent in enumerate(results):
        if numel % k == 0:
            assert sent["ring"] == 2 * (k - 1) * size // k
        # each phase sends every chunk but one: its own (reduce-scatter), r+1's (all-gather)
        assert sent["ring"] == 2 * size - chunks[rank] - chunks[(rank + 1) % k]
        assert sent["native"] == sent["ring"]  # native is recorded with the ring formula
        assert sent["tree"] == expected_tree_all_reduce_sent(size, k, rank)
        assert sent["rs_ring"] == sent["rs_native"] == size - chunks[rank]
        shard = 4 * (numel // k)
        assert sent["ag_ring"] == sent["ag_native"] == (k - 1) * shard
    # the tree moves 2 (k-1) S in all, like the ring, but unevenly: the root sends most
    assert sum(s["tree"] for s in results) == 2 * (k - 1) * size
