"""Codecs for DiLoCo's outer gradients (comm/codecs.py) and the mean sent in them
(comm/low_precision.py): each codec's error within its format's bound, the same bytes the
planner counts, every rank ending with the same vector, and int8 and fp4 at least 3.9 and
7.5 times fewer bytes on the ledger than a float32 ring all-reduce."""

from __future__ import annotations

import pytest
import torch

from paratrain.comm.codecs import CODECS
from paratrain.plan.codec_bytes import encoded_bytes
from paratrain.plan.rank_diloco import outer_bytes
from tests.distributed import run_distributed

# The largest rounding error of one encoding, from the format (comm/codecs.py), for a
# vector whose largest magnitude is `top`: bfloat16 keeps 8 significant bits (half a unit
# in the last place: 2^-8 relative); int8 to half a step of absmax / 127; fp4's
# widest gap, between 4 and 6 of absmax / 6 units, gives at most one unit; sign's x
# becomes +-mean|x| of its block, at most max(|x|, mean|x|) <= absmax away.
BOUNDS = {"bfloat16": lambda top: top * 2.0**-8, "int8": lambda top: top / 127 / 2,
          "fp4": lambda top: top / 6, "sign": lambda top: top}  # fmt: skip


def _vector(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.rand(n, generator=g) * 3
    x[: min(n, 300)] = 0  # a block of zeros: scale 0, decoded exactly
    return x


@pytest.mark.parametrize("name", list(CODECS))
@pytest.mark.parametrize("n", [1, 7, 256, 257, 1000, 4099])
def test_a_codec_round_trips_within_its_bound_in_the_bytes_the_planner_counts(name, n):
    codec, x = CODECS[name], _vector(n, n)
    data = codec.encode(x)
    assert data.dtype == torch.uint8 and data.numel() == codec.nbytes(n) == encoded_bytes(n, name)
    shifted = torch.cat([torch.zeros(1, dtype=torch.uint8), data])[1:]  # at an odd offset
    y = codec.decode(shifted, n)
    top = x.abs().max().item()
    assert (y - x).abs().max().item() <= BOUNDS[name](top)
    assert torch.equal(y[: min(n, 256)], torch.zeros(min(n, 256)))


def _mean_of(rank: int, world: int, name: str, n: int) -> tuple:
    from paratrain.comm import Ledger
    from paratrain.comm.low_precision import encoded_mean
    from paratrain.mesh import Mesh

    ledger = Ledger()
    mesh = Mesh.build(dp=world, ledger=ledger)
    x = _vector(n, 100 + rank)
    mean = encoded_mean(x, mesh.group("dp"), CODECS[name])
    sent = ledger.bytes_sent(group="dp")
    mesh.close()
    return mean, sent


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", list(CODECS))
def test_the_encoded_mean_is_the_same_everywhere_within_two_roundings(world, name):
    """3 ranks cut 10,001 elements unevenly. Every rank gets the same vector; each element
    is within the senders' mean encoding error plus the mean's own of the float64 mean;
    each rank sent what the planner counts (plan/rank_diloco.py `outer_bytes`), for int8
    and fp4 at least 3.9 and 7.5 times fewer bytes than a float32 ring all-reduce."""
    from paratrain.plan.comm import ring_all_reduce_rank_bytes

    n = 10_001
    results = run_distributed(_mean_of, world, name, n)
    exact = torch.stack([_vector(n, 100 + r).double() for r in range(world)]).mean(0)
    top = max(_vector(n, 100 + r).abs().max().item() for r in range(world))
    bound = 2 * BOUNDS[name](top)  # the senders' errors averaged, then the mean's
    for rank, (mean, sent) in enumerate(results):
        assert torch.equal(mean, results[0][0])
        assert (mean.double() - exact).abs().max().item() <= bound
        assert sent == outer_bytes(n, name, world, rank)
        ratio = ring_all_reduce_rank_bytes(n, 4, world, rank) / sent
        assert ratio >= {"bfloat16": 1.9, "int8": 3.9, "fp4": 7.5, "sign": 28}[name], ratio
