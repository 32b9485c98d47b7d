"""`paratrain bench cp`: our context-parallel attention at 2 ranks against single-process
attention of the same sequence (compare.py says what each side runs).

Checked, or the bench fails (RuntimeError, exit status 1): the output and dq, dk, dv of
every rank equal the peer's shard of them within TOLERANCE (float32, relative to the
largest magnitude), and the ledger's messages and bytes of one forward and backward equal
`plan/context_cost.py`'s formulas. Reported: both sides' median times and the
pairwise ratio ours / peer with its spread (alternating pairs, harness/pairs.py), bytes per
rank, and the bytes autograd saves for backward on each side. Ours splits the work over 2
processes; the peer runs the whole sequence in each of them, at the same time, so both
sides load both cores alike.
"""

from __future__ import annotations

import logging
from typing import Any

from paratrain.bench.cp.compare import METHODS, compare_methods
from paratrain.bench.harness.pairs import ratio_summary
from paratrain.plan.context_cost import (
    ring_bytes,
    ring_messages,
    ulysses_bytes,
    ulysses_messages,
)
from paratrain.spawn import run_ranks

log = logging.getLogger(__name__)
WORLD = 2  # on 2 cores only 2-rank timings mean anything
TOLERANCE = 1e-4
ELEM = 4  # float32
PEER = (
    "torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True) on the whole "
    "sequence in one process, keys and values repeated to every query head "
    "(repeat_interleave), backward by autograd; float32, 1 thread"
)


def expected_sent(method: str, shape: dict[str, int], cp: int) -> dict[str, tuple[int, float]]:
    """{op: (messages, bytes)} one rank sends in one forward and backward."""
    b, h, kv, s, d = (shape[k] for k in ("batch", "heads", "kv_heads", "seq", "head_dim"))
    if method == "alltoall":
        return {
            "all_to_all": (2 * ulysses_messages(cp), 2 * ulysses_bytes(b, s, h, kv, d, ELEM, cp))
        }
    messages = ring_messages(cp) + ring_messages(cp, backward=True)
    return {
        "send": (
            messages,
            ring_bytes(b, s, kv, d, ELEM, cp) + ring_bytes(b, s, kv, d, ELEM, cp, True),
        )
    }


def check_shape(methods: list[str], shape: dict[str, int], pairs: int) -> None:
    """ValueError naming the value, before any rank starts."""
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"--methods {m!r}; valid: {', '.join(METHODS)}")
    for name, value in shape.items():
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} {value}; must be at least 1")
    if shape["heads"] % shape["kv_heads"]:
        raise ValueError(f"--kv-heads {shape['kv_heads']} does not divide --heads {shape['heads']}")
    if shape["seq"] % (2 * WORLD):
        raise ValueError(f"--seq-len {shape['seq']}: must split into {2 * WORLD} balanced chunks")
    if "alltoall" in methods and shape["kv_heads"] % WORLD:
        raise ValueError(f"--kv-heads {shape['kv_heads']}: all-to-all needs a multiple of {WORLD}")
    if pairs < 2:
        raise ValueError(f"--pairs {pairs}: need at least 2 for a median")


def run_cp_bench(methods: list[str], shape: dict[str, int], pairs: int) -> dict[str, Any]:
    check_shape(methods, shape, pairs)
    per_rank = run_ranks(compare_methods, WORLD, methods, shape, pairs, timeout=1800)
    results = {m: summarize(m, [r[i] for r in per_rank], shape) for i, m in enumerate(methods)}
    log_report(results, shape)
    return {"shape": shape, "world": WORLD, "peer": PEER, "methods": results}


def summarize(method: str, ranks: list[dict[str, Any]], shape: dict[str, int]) -> dict[str, Any]:
    want = expected_sent(method, shape, WORLD)
    for rank, r in enumerate(ranks):
        worst = max(r["relative_errors"].values())
        if not worst <= TOLERANCE:
            raise RuntimeError(
                f"{method}: rank {rank} differs from single-process attention by {worst:.1e} "
                f"(relative, tolerance {TOLERANCE:g}): {r['relative_errors']}"
            )
        sent = {op: v for op, v in r["sent"].items() if op != "recv"}
        if sent != want:
            raise RuntimeError(f"{method}: rank {rank} sent {sent}, the formula says {want}")
    ours = [max(r["rows"][i][0] for r in ranks) for i in range(len(ranks[0]["rows"]))]
    peer = [max(r["rows"][i][1] for r in ranks) for i in range(len(ranks[0]["rows"]))]
    return {
        **ratio_summary(ours, peer),
        "bytes_per_rank": {op: b for op, (_, b) in want.items()},
        "messages_per_rank": {op: n for op, (n, _) in want.items()},
        "max_relative_error": max(max(r["relative_errors"].values()) for r in ranks),
        "saved_bytes": {
            side: max(r["saved_bytes"][side] for r in ranks) for side in ("ours", "peer")
        },
    }


def log_report(results: dict[str, dict[str, Any]], shape: dict[str, int]) -> None:
    log.info(
        "causal attention, batch %d, %d heads (%d key/value), head dim %d, sequence %d; "
        "cp=%d on gloo, load-balanced chunks, float32, 1 thread per rank",
        shape["batch"], shape["heads"], shape["kv_heads"], shape["head_dim"], shape["seq"], WORLD,
    )  # fmt: skip
    log.info("peer: %s", PEER)
    for method, s in results.items():
        log.info(
            "%s: median ours %.4f s, single process %.4f s; ratio median %.3f (IQR %.3f-%.3f, "
            "range %.3f-%.3f) over %d pairs",
            method, s["ours_step_s"], s["torch_step_s"], s["ratio"], s["ratio_q1"],
            s["ratio_q3"], s["ratio_min"], s["ratio_max"], s["pairs"],
        )  # fmt: skip
        log.info(
            "%s: sent per rank per forward+backward %s in %s messages (ledger = formula); "
            "saved for backward: ours %s B per rank, single process %s B; max relative "
            "error %.1e",
            method, s["bytes_per_rank"], s["messages_per_rank"], f"{s['saved_bytes']['ours']:,}",
            f"{s['saved_bytes']['peer']:,}", s["max_relative_error"],
        )  # fmt: skip
