"""Context-parallel attention is invisible to the numbers, and costs what the formulas say.

In float64 the ring (plain and load-balanced layouts) and the all-to-all attention give
the output and the gradients dq, dk, dv of full single-process attention (torch's SDPA on
the whole sequence) to 1e-12: the blocks are merged in a different order than one softmax
over all keys, so the results are equal up to rounding, not bitwise. Messages and bytes
per rank per pass equal plan/context_cost.py's formulas exactly, as recorded by the ledger; per-rank
attention FLOPs, as torch's FlopCounterMode counts them, are equal across ranks under load
balancing and not without it.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from paratrain.comm.group import CommGroup, CommOptions
from paratrain.comm.ledger import Ledger
from paratrain.parallel.context_parallel import (
    inverse,
    permutation,
    positions,
    ring,
    ring_attention,
    shard,
    ulysses_attention,
)
from paratrain.parallel.context_parallel.layout import chunks_of, visibility
from paratrain.plan.context_cost import (
    ring_blocks,
    ring_bytes,
    ring_flops,
    ring_messages,
    ulysses_bytes,
    ulysses_messages,
)
from tests.distributed import run_distributed

B, HEADS, KV_HEADS, S, D = 2, 8, 4, 16, 8  # grouped-query: two query heads per kv head
METHODS = ["ring", "ring_balanced", "ulysses", "ulysses_balanced"]
TOL = 1e-12


def full_inputs() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    shapes = [(B, HEADS, S, D), (B, KV_HEADS, S, D), (B, KV_HEADS, S, D), (B, HEADS, S, D)]
    return tuple(torch.randn(shape, generator=g, dtype=torch.float64) for shape in shapes)


def reference(causal: bool) -> tuple[torch.Tensor, ...]:
    """Output and dq, dk, dv of full attention, for the upstream gradient `w`."""
    q, k, v, w = full_inputs()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    group = HEADS // KV_HEADS
    kf, vf = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q, kf, vf, is_causal=causal)
    (out * w).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def run_method(method: str, group: CommGroup, causal: bool) -> tuple[torch.Tensor, ...]:
    """This rank's output and dq, dk, dv, and the ledger's totals after each pass."""
    balanced = method.endswith("balanced")
    q, k, v, w = (shard(t, group.size, group.rank, balanced, dim=2) for t in full_inputs())
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    attend = ulysses_attention if method.startswith("ulysses") else ring_attention
    group.ledger.reset()
    out = attend(q, k, v, group, causal=causal, balanced=balanced)
    forward = group.ledger.totals()
    group.ledger.reset()
    (out * w).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad, forward, group.ledger.totals()


def expected_traffic(method: str, cp: int, backward: bool) -> dict[str, tuple[int, int]]:
    """{op: (messages, bytes sent)} per rank per pass."""
    if cp == 1:
        return {}
    if method.startswith("ulysses"):
        return {
            "all_to_all": (ulysses_messages(cp), ulysses_bytes(B, S, HEADS, KV_HEADS, D, 8, cp))
        }
    return {"send": (ring_messages(cp, backward), ring_bytes(B, S, KV_HEADS, D, 8, cp, backward))}


def check_parity(rank: int, cp: int, order: str = "nccl") -> list[str]:
    group = CommGroup.world(Ledger(), name="cp", options=CommOptions(order=order, timeout_s=30))
    failures = []
    for causal in (True, False):
        want = reference(causal)
        for method in METHODS:
            balanced = method.endswith("balanced")
            *got, forward, backward = run_method(method, group, causal)
            what = f"rank {rank}/{cp} {method} causal={causal}"
            for name, g, full in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
                err = (g - shard(full, cp, rank, balanced, dim=2)).abs().max().item()
                if not err <= TOL:
                    failures.append(f"{what}: {name} differs by {err:.2e}")
            for pass_name, totals, bwd in (
                ("forward", forward, False),
                ("backward", backward, True),
            ):
                counted = {op: (t.messages, t.bytes_sent) for (_, op), t in totals.items()}
                if method.startswith("ring"):  # ring: every rank receives what its left one sends
                    received = totals.pop(("cp", "recv"), None)
                    counted.pop("recv", None)
                    if (received.bytes_recv if received else 0) != counted.get("send", (0, 0))[1]:
                        failures.append(f"{what} {pass_name}: received {received}")
                if counted != expected_traffic(method, cp, bwd):
                    failures.append(
                        f"{what} {pass_name}: ledger {counted} != "
                        f"formula {expected_traffic(method, cp, bwd)}"
                    )
    return failures


@pytest.mark.parametrize("cp", [pytest.param(2, marks=pytest.mark.equivalence), 4])
def test_attention_equals_full_attention_and_counts_the_formulas(cp):
    """Under NCCL's order (comm/ordering.py): at cp 2 a ring that posted its receive
    alone, ahead of its send, deadlocked there (issue 28)."""
    failures = [f for rank in run_distributed(check_parity, cp) for f in rank]
    assert not failures, "\n".join(failures[:20])


def test_a_group_of_one_rank_is_plain_attention():
    group = CommGroup("cp", None, [0], 0, Ledger())
    for causal in (True, False):
        want = reference(causal)
        for method in METHODS:
            got = run_method(method, group, causal)
            for g, full in zip(got[:4], want, strict=True):
                assert (g - full).abs().max().item() <= TOL, (method, causal)
            assert got[4] == got[5] == {}  # nothing sent


def count_flops(rank: int, cp: int) -> dict[str, tuple[int, int]]:
    """Per method: (forward, backward) FLOPs of this rank, counted by torch."""
    group = CommGroup.world(Ledger(), name="cp")
    counted = {}
    for method in METHODS:
        balanced = method.endswith("balanced")
        q, k, v, w = (shard(t, cp, rank, balanced, dim=2) for t in full_inputs())
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        attend = ulysses_attention if method.startswith("ulysses") else ring_attention
        with FlopCounterMode(display=False) as forward:
            out = attend(q, k, v, group, causal=True, balanced=balanced)
        with FlopCounterMode(display=False) as backward:
            (out * w).sum().backward()
        counted[method] = (forward.get_total_flops(), backward.get_total_flops())
    return counted


def test_load_balancing_evens_the_flops_of_causal_ring_attention():
    cp = 4
    per_rank = run_distributed(count_flops, cp)
    balanced = [r["ring_balanced"] for r in per_rank]
    plain = [r["ring"] for r in per_rank]
    assert len(set(balanced)) == 1, balanced
    assert len(set(plain)) == cp, plain  # rank r does r + 1 blocks: all different
    for rank in range(cp):
        for method, counts in (("ring", plain[rank]), ("ring_balanced", balanced[rank])):
            bal = method == "ring_balanced"
            assert counts == (
                ring_flops(B, HEADS, S, D, cp, rank, causal=True, balanced=bal),
                ring_flops(B, HEADS, S, D, cp, rank, causal=True, balanced=bal, backward=True),
            )
    for method in ("ulysses", "ulysses_balanced"):  # whole sequence, h/cp heads each
        assert len({r[method] for r in per_rank}) == 1
    # The busiest rank: 2cp+1 blocks of (s/2cp)^2 against cp blocks of (s/cp)^2, so
    # balancing cuts the step's critical path to (2cp+1)/(4cp) (9/16 at cp 4).
    assert max(balanced)[0] * 4 * cp == max(plain)[0] * (2 * cp + 1)


def record_overlap(rank: int, cp: int) -> list[str]:
    """Times each block's compute; the ledger says when each send was posted."""
    group = CommGroup.world(Ledger(), name="cp")
    spans = []
    attend_source = ring._attend_source

    def timed(*args, **kwargs):
        start = time.perf_counter()
        attend_source(*args, **kwargs)
        spans.append((start, time.perf_counter()))

    ring._attend_source = timed  # this rank's process only
    q, k, v, _ = (shard(t, cp, rank, True, dim=2) for t in full_inputs())
    ring_attention(q, k, v, group, causal=True, balanced=True)
    sends = [r for r in group.ledger.recent() if r.op == "send"]
    failures = []
    for step, (send, (compute_start, _)) in enumerate(zip(sends, spans[:-1], strict=True)):
        if not send.start < compute_start:
            failures.append(f"rank {rank} step {step}: send posted after the compute began")
    return failures


def test_next_keys_are_sent_before_the_current_block_is_computed():
    failures = [f for rank in run_distributed(record_overlap, 4) for f in rank]
    assert not failures, "\n".join(failures)


# ---- pure: the layout and the formulas ----------------------------------------------------


@pytest.mark.parametrize("balanced", [False, True])
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_layout_permutation_and_its_inverse(cp, balanced):
    s = 4 * cp
    perm = permutation(s, cp, balanced)
    assert sorted(perm.tolist()) == list(range(s))
    assert torch.equal(perm[inverse(perm)], torch.arange(s))
    x = torch.arange(s)
    assert torch.equal(torch.cat([shard(x, cp, r, balanced, 0) for r in range(cp)]), perm)
    assert torch.equal(torch.cat([positions(s, cp, r, balanced) for r in range(cp)]), perm)
    if balanced:  # rank r: chunks r and 2cp-1-r of length 2
        assert positions(s, cp, 0, True).tolist() == [0, 1, s - 2, s - 1]


def test_balanced_blocks_are_equal_and_plain_ones_grow_with_rank():
    for cp in range(1, 9):
        assert {ring_blocks(r, cp, True, True) for r in range(cp)} == {2 * cp + 1}
        assert [ring_blocks(r, cp, True, False) for r in range(cp)] == list(range(1, cp + 1))
        assert ring_blocks(0, cp, False, True) == 4 * cp  # no mask: every chunk


def test_ring_blocks_count_the_runtime_layout():
    """The planner's closed form against the blocks the runtime's layout visits."""
    for cp in range(1, 9):
        for causal in (True, False):
            for balanced in (True, False):
                every = [c for r in range(cp) for c in chunks_of(r, cp, balanced)]
                for rank in range(cp):
                    mine = chunks_of(rank, cp, balanced)
                    visits = sum(1 for q in mine for kv in every if visibility(q, kv, causal))
                    assert ring_blocks(rank, cp, causal, balanced) == visits


def test_ring_bytes_are_the_issue_formula():
    b, s, h_kv, d, elem, cp = 2, 1024, 8, 64, 2, 4
    forward = 2 * b * s * h_kv * d * elem * (cp - 1) // cp
    assert ring_bytes(b, s, h_kv, d, elem, cp) == forward
    assert ring_bytes(b, s, h_kv, d, elem, cp, backward=True) == 2 * forward


@pytest.mark.parametrize("heads, kv_heads", [(6, 4), (8, 2)])
def test_all_to_all_refuses_heads_that_cp_does_not_divide(heads, kv_heads):
    group = SimpleNamespace(size=4)  # the check comes before any communication
    q, kv = torch.zeros(1, heads, 4, 2), torch.zeros(1, kv_heads, 4, 2)
    with pytest.raises(ValueError, match=f"cp=4: heads {heads} and kv_heads {kv_heads} must"):
        ulysses_attention(q, kv, kv, group)


def test_uneven_sequences_are_refused_naming_the_numbers():
    with pytest.raises(ValueError, match="length 12 is not divisible by 8"):
        permutation(12, 4, balanced=True)
