"""Every primitive against ground truth, for every algorithm, reduce op, dtype and size class,
at every world size from 1 to 8.

Each rank's input is a function of (rank, dtype, size), so every rank can compute the exact
expected result locally in float64. Integers, max and min must match exactly (bitwise);
floating sums within the rounding of their dtype, since algorithms add in different orders.
One multi-process run per world size loops over the whole matrix and returns the failures.
"""

from __future__ import annotations

import pytest
import torch

from paratrain import comm
from paratrain.comm.traffic import chunk_sizes
from paratrain.mesh import Mesh
from tests.distributed import run_distributed

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64]
SIZES = [0, 1, 13, 1000]  # empty, scalar-like, not divisible by any k > 1, larger
OPS = ["sum", "avg", "max", "min"]
RTOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def rank_input(rank: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + numel)
    if dtype == torch.int64:
        return torch.randint(-50, 50, (numel,), generator=g)
    return torch.randn(numel, generator=g).to(dtype)


def expected_reduction(k: int, dtype: torch.dtype, numel: int, op: str) -> torch.Tensor:
    stack = torch.stack([rank_input(r, dtype, numel).double() for r in range(k)])
    if op == "max":
        return stack.max(0).values
    if op == "min":
        return stack.min(0).values
    total = stack.sum(0)
    if op == "avg":
        return torch.floor(total / k) if dtype == torch.int64 else total / k
    return total


def matches(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, op: str) -> bool:
    if got.dtype != dtype or got.shape != want.shape:
        return False
    if dtype == torch.int64 or op in ("max", "min"):
        return torch.equal(got.double(), want.to(dtype).double())
    scale = want.abs().max().item() if want.numel() else 0.0
    return torch.allclose(got.double(), want, rtol=RTOL[dtype], atol=RTOL[dtype] * (1 + scale))


def check_matrix(rank: int, world_size: int) -> list[str]:
    """Run every case on this rank; return descriptions of the failures."""
    mesh = Mesh.build(dp=world_size)
    group = mesh.group("dp")
    failures = []

    def expect(ok: bool, what: str) -> None:
        if not ok:
            failures.append(f"rank {rank}/{world_size}: {what}")

    for dtype in DTYPES:
        for numel in SIZES:
            mine = rank_input(rank, dtype, numel)
            for op in OPS:
                want = expected_reduction(world_size, dtype, numel, op)
                for algo in ("native", "ring", "tree"):
                    got = comm.all_reduce(mine.clone(), group, op=op, algo=algo)
                    expect(matches(got, want, dtype, op), f"all_reduce {algo} {op} {dtype} {numel}")
                for algo in ("native", "ring"):
                    got = comm.reduce_scatter(mine.clone(), group, op=op, algo=algo)
                    part = want.split(chunk_sizes(numel, world_size))[rank]
                    expect(
                        matches(got, part, dtype, op), f"reduce_scatter {algo} {op} {dtype} {numel}"
                    )
                for algo in ("native", "tree"):
                    dst = world_size - 1
                    got = comm.reduce(mine.clone(), group, dst=dst, op=op, algo=algo)
                    if rank == dst:
                        expect(matches(got, want, dtype, op), f"reduce {algo} {op} {dtype} {numel}")
            for algo in ("native", "tree"):
                src = world_size // 2
                got = comm.broadcast(mine.clone(), group, src=src, algo=algo)
                expect(
                    torch.equal(got, rank_input(src, dtype, numel)),
                    f"broadcast {algo} {dtype} {numel}",
                )
            for algo in ("native", "ring"):
                # uneven: rank r contributes r + numel elements
                piece = rank_input(rank, dtype, numel + rank)
                got = comm.all_gather_flat(piece, group, algo=algo)
                want = torch.cat([rank_input(r, dtype, numel + r) for r in range(world_size)])
                expect(torch.equal(got, want), f"all_gather_flat {algo} {dtype} {numel}")
    return failures


@pytest.mark.parametrize("world_size", range(1, 9))
def test_primitives_match_ground_truth(world_size):
    failures = run_distributed(check_matrix, world_size)
    flat = [f for rank_failures in failures for f in rank_failures]
    assert not flat, "\n".join(flat[:20])


def shaped_ops(rank: int, world_size: int) -> dict:
    mesh = Mesh.build(dp=world_size)
    group = mesh.group("dp")
    out = {}
    # all_gather keeps shapes; the first dimension may differ between ranks
    rows = torch.full((rank + 1, 3), float(rank))
    out["all_gather"] = [t.shape for t in comm.all_gather(rows, group)]
    out["all_gather_values"] = [t[0, 0].item() for t in comm.all_gather(rows, group)]
    # scatter and gather with uneven chunks
    chunks = [torch.arange(r + 2, dtype=torch.float32) for r in range(world_size)]
    got = torch.empty(rank + 2)
    comm.scatter(got, group, src=1, chunks=chunks if rank == 1 else None)
    out["scatter"] = got.tolist()
    gathered = comm.gather(
        torch.full((rank + 1,), float(rank)),
        group,
        dst=0,
        shapes=[torch.Size([r + 1]) for r in range(world_size)] if rank == 0 else None,
    )
    out["gather"] = None if gathered is None else [t.tolist() for t in gathered]
    # non-contiguous input to all_reduce: the result lands in the caller's tensor
    base = torch.arange(12, dtype=torch.float32).view(3, 4) * (rank + 1)
    view = base.t()
    comm.all_reduce(view, group)
    out["non_contiguous"] = base.tolist()
    # asynchronous all-reduce and point-to-point
    handle = comm.all_reduce(torch.ones(5) * rank, group, async_op=True)
    out["async"] = handle.wait().tolist()
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    send = comm.isend(torch.tensor([float(rank)]), group, right)
    received = comm.recv(torch.empty(1), group, left)
    send.wait()
    out["p2p"] = received.item()
    comm.barrier(group)
    out["report"] = comm.gather_report(group)
    return out


def test_shapes_uneven_chunks_async_and_p2p():
    k = 3
    results = run_distributed(shaped_ops, k)
    for rank, out in enumerate(results):
        assert out["all_gather"] == [torch.Size([r + 1, 3]) for r in range(k)]
        assert out["all_gather_values"] == [0.0, 1.0, 2.0]
        assert out["scatter"] == list(range(rank + 2))
        expected_gather = [[float(r)] * (r + 1) for r in range(k)] if rank == 0 else None
        assert out["gather"] == expected_gather
        assert out["non_contiguous"] == (torch.arange(12.0).view(3, 4) * 6).tolist()
        assert out["async"] == [3.0] * 5
        assert out["p2p"] == float((rank - 1) % k)
        report = out["report"]
        assert set(report["ranks"]) == {0, 1, 2} and "bandwidth-optimal" in report["note"]
        ops = report["ranks"][rank]["dp"]
        assert ops["all_reduce"]["calls"] == 2 and ops["barrier"]["calls"] == 1
        assert ops["send"]["bytes_sent"] == 4 and ops["recv"]["bytes_recv"] == 4


def test_bad_arguments_are_refused():
    from paratrain.comm import CommGroup, Ledger

    group = CommGroup("solo", None, [0], 0, Ledger())
    with pytest.raises(ValueError, match="reduce op 'prod'; valid: sum, avg, max, min"):
        comm.all_reduce(torch.ones(2), group, op="prod")
    with pytest.raises(ValueError, match="sizes \\[1, 1\\] must be 1 numbers"):
        comm.reduce_scatter(torch.ones(2), group, sizes=[1, 1])
    with pytest.raises(ValueError, match="comm algo 'star'; valid: native, ring, tree"):
        comm.CommOptions(algo="star")
