"""Error-feedback compression of the gradient reductions (parallel/data_parallel/
compression.py): nothing is lost, only late; PowerSGD at full rank is the exact mean; the
reduce-scatter gives each rank its chunk of the same mean; every rank ends equal."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed

ULP = 2.0**-24  # float32's unit roundoff
SHAPES = [torch.Size([6, 5]), torch.Size([5]), torch.Size([4, 3, 2]), torch.Size([7])]
NUMEL = sum(s.numel() for s in SHAPES)


def _shapes() -> list[tuple[int, torch.Size]]:
    out, at = [], 0
    for s in SHAPES:
        out.append((at, s))
        at += s.numel()
    return out


def _gradient(rank: int, step: int) -> torch.Tensor:
    """A rank's gradient: a drift that every step shares (so the sum over steps grows,
    as a training gradient's does) and noise of its own."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    drift = torch.linspace(-1, 1, NUMEL)
    return drift + torch.randn(NUMEL, generator=g)


def _run(rank: int, world: int, method: str, scatter: bool, steps: int, r: int) -> dict:
    from paratrain.comm.traffic import chunk_sizes
    from paratrain.mesh import Mesh
    from paratrain.parallel.data_parallel.compression import (
        CompressSettings,
        GradCompressor,
        Reduced,
    )
    from paratrain.parallel.data_parallel.powersgd import matrices_of

    mesh = Mesh.build(dp=world)
    group = mesh.group("dp")
    sizes = chunk_sizes(NUMEL, world)
    owned = 0 if scatter else sizes[rank]
    buffer = Reduced("b", NUMEL, owned, matrices_of(_shapes(), r) if method == "powersgd" else [])
    compressor = GradCompressor(CompressSettings(method, rank=r), [buffer], torch.device("cpu"))
    applied = []
    for step in range(steps):
        out = compressor.reduce(
            "b", _gradient(rank, step), group, "avg", sizes if scatter else None
        )
        applied.append(out)
        compressor.finish_step()
    state = {k: t.clone() for k, t in compressor.state_tensors().items()}
    mesh.close()
    return {"applied": applied, "state": state}


def _true_sum(world: int, steps: int) -> torch.Tensor:
    return sum(
        torch.stack([_gradient(r, s).double() for r in range(world)]).mean(0) for s in range(steps)
    )


@pytest.mark.parametrize("scatter", [False, True], ids=["all-reduce", "reduce-scatter"])
@pytest.mark.parametrize("method", ["powersgd", "int8", "sign"])
def test_the_applied_updates_and_the_errors_left_sum_to_the_true_gradients(method, scatter):
    """50 steps on 3 ranks: the sum of what was applied plus the errors still held (the
    ranks' mean error and, in a codec all-reduce, the owners' second rounding) equals the
    sum of the true mean gradients, 1e-6 relative (float32 roundings: a few per element per
    step, far below it). Every rank applies the same update; the errors are not zero (the
    compression loses something, so the identity is not vacuous)."""
    world, steps = 3, 50
    results = run_distributed(_run, world, method, scatter, steps, 1)
    if scatter:  # each rank's chunk of the mean: concatenated in rank order
        applied = [torch.cat([res["applied"][s] for res in results]) for s in range(steps)]
    else:
        for res in results:
            for s in range(steps):
                assert torch.equal(res["applied"][s], results[0]["applied"][s])
        applied = results[0]["applied"]
    residual = torch.stack([res["state"]["error.b"].double() for res in results]).mean(0)
    if not scatter and method != "powersgd":
        residual += torch.cat([res["state"]["server.b"].double() for res in results])
    assert residual.abs().max() > 1e-3  # something was held back
    total = sum(a.double() for a in applied) + residual
    truth = _true_sum(world, steps)
    assert (total - truth).norm() <= 1e-6 * truth.norm(), (total - truth).norm() / truth.norm()


def _full_rank(rank: int, world: int) -> tuple:
    from paratrain.mesh import Mesh
    from paratrain.parallel.data_parallel.powersgd import Matrix, powersgd_mean

    mesh = Mesh.build(dp=world)
    group = mesh.group("dp")

    def mean(t: torch.Tensor) -> torch.Tensor:
        from paratrain import comm

        comm.all_reduce(t, group, op="avg")
        return t

    matrices = [Matrix(0, 8, 5), Matrix(40, 3, 9), Matrix(70, 6, 6)]
    out = {}
    for dtype in (torch.float64, torch.float32):
        v = torch.randn(110, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
        g = torch.Generator().manual_seed(7)  # the same Q on both ranks
        factors = [
            torch.randn(m.cols, min(m.rows, m.cols), generator=g, dtype=torch.float64).to(dtype)
            for m in matrices
        ]
        out[dtype] = powersgd_mean(v.to(dtype), matrices, factors, mean)
    mesh.close()
    return out


def test_powersgd_at_full_rank_is_the_exact_mean():
    """Rank min(rows, cols) for every matrix (taller and wider ones, a square one) and
    exact elements between them, on 2 ranks: the float64 mean within 1e-12 in float64, and
    in float32 within a QR's rounding, n * 2^-24 of each matrix's norm with a factor 16 for
    the products around it (Higham, Accuracy and Stability, theorem 19.4)."""
    results = run_distributed(_full_rank, 2)
    exact = torch.stack(
        [torch.randn(110, generator=torch.Generator().manual_seed(r), dtype=torch.float64)
         for r in range(2)]
    ).mean(0)  # fmt: skip
    for out in results:
        assert (out[torch.float64] - exact).abs().max() <= 1e-12
        for a, b, n in [(0, 40, 8), (40, 67, 9), (70, 106, 6)]:
            diff = (out[torch.float32][a:b].double() - exact[a:b]).norm()
            assert diff <= 16 * n * ULP * exact[a:b].norm(), diff
        for a, b in [(67, 70), (106, 110)]:  # averaged exactly: two float32 roundings
            diff = (out[torch.float32][a:b].double() - exact[a:b]).abs().max()
            assert diff <= 2 * ULP * exact.abs().max()
