"""all_to_all, both algorithms, against torch.distributed.all_to_all_single and against the
result every rank can compute locally, at k = 2, 3, 4: equal and uneven splits, empty
chunks, float32/float64/int64. Results must be bitwise equal (an all-to-all only moves
values), and the ledger's bytes and messages equal `traffic.pairwise_all_to_all` exactly.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from paratrain import comm
from paratrain.comm.all_to_all import ALGOS
from paratrain.comm.group import CommGroup
from paratrain.comm.ledger import Ledger
from paratrain.comm.traffic import Traffic, pairwise_all_to_all
from tests.distributed import run_distributed

DTYPES = [torch.float32, torch.float64, torch.int64]
ROW = (2, 3)  # each row of dimension 0 is 6 elements


def split_cases(k: int) -> dict[str, list[list[int]]]:
    """Per case, rows[r][p] = how many rows rank r sends to rank p."""
    return {
        "equal": [[2] * k for _ in range(k)],
        "uneven": [[(r + 2 * p) % 3 for p in range(k)] for r in range(k)],  # zeros included
        "one_rank_silent": [[0 if r == 1 else p + 1 for p in range(k)] for r in range(k)],
        "empty": [[0] * k for _ in range(k)],
    }


def rank_input(rank: int, rows: int, dtype: torch.dtype) -> torch.Tensor:
    values = torch.arange(rows * 6).view(rows, *ROW) + 1000 * rank
    return values.to(dtype) if dtype == torch.int64 else (values / 7).to(dtype)


def expected(rank: int, k: int, sends: list[list[int]], dtype: torch.dtype) -> torch.Tensor:
    """Chunk `rank` of every rank's input, in rank order."""
    pieces = [rank_input(src, sum(sends[src]), dtype).split(sends[src])[rank] for src in range(k)]
    return torch.cat(pieces)


def check_all(rank: int, k: int) -> list[str]:
    ledger = Ledger()
    group = CommGroup.world(ledger, name="a2a")
    failures = []
    for case, sends in split_cases(k).items():
        ins, outs = sends[rank], [sends[src][rank] for src in range(k)]
        for dtype in DTYPES:
            x = rank_input(rank, sum(ins), dtype)
            torch_out = x.new_empty((sum(outs), *ROW))
            dist.all_to_all_single(torch_out, x, outs, ins)
            want = expected(rank, k, sends, dtype)
            row = 6 * x.element_size()
            formula = pairwise_all_to_all([n * row for n in ins], [n * row for n in outs], rank)
            for algo in ALGOS:
                for async_op in (False, True):
                    ledger.reset()
                    kwargs = {} if case == "equal" else {"input_split_sizes": ins}
                    kwargs |= {} if case == "equal" else {"output_split_sizes": outs}
                    got = comm.all_to_all(x, group, algo=algo, async_op=async_op, **kwargs)
                    got = got.wait() if async_op else got
                    t = ledger.totals()[("a2a", "all_to_all")]
                    counted = Traffic(t.bytes_sent, t.bytes_recv, t.messages)
                    what = f"rank {rank}/{k} {case} {dtype} {algo} async={async_op}"
                    if not (torch.equal(got, torch_out) and torch.equal(got, want)):
                        failures.append(f"{what}: wrong values")
                    if counted != formula:
                        failures.append(f"{what}: ledger {counted} != formula {formula}")
    return failures


@pytest.mark.parametrize("k", [2, 3, 4])
def test_all_to_all_matches_torch_and_counts_the_formula(k):
    failures = [f for rank in run_distributed(check_all, k) for f in rank]
    assert not failures, "\n".join(failures[:20])


def test_even_split_sends_k_minus_1_messages_of_s_over_k():
    """The issue's statement of the formula: S bytes split evenly over k ranks."""
    k, s = 4, 4096
    for rank in range(k):
        assert pairwise_all_to_all([s // k] * k, [s // k] * k, rank) == Traffic(
            (k - 1) * s // k, (k - 1) * s // k, k - 1
        )


@pytest.mark.parametrize(
    "shape, ins, outs, algo, needle",
    [
        ((5, 2), None, None, None, "5 is not divisible by 3"),
        ((4,), [1, 1, 2], None, None, "both"),
        ((4,), [1, 1, 1], [1, 1, 1], None, "adding up to 4"),
        ((4,), [1, 1, 2, 0], [1, 1, 1], None, "do not fit"),
        ((3,), None, None, "ring", "'ring'"),
    ],
)
def test_bad_calls_say_what_is_wrong(shape, ins, outs, algo, needle):
    group = SimpleNamespace(size=3, name="cp", rank=0)
    with pytest.raises(ValueError, match=needle):
        comm.all_to_all(torch.zeros(shape), group, ins, outs, algo=algo)
