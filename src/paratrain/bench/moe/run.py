"""`paratrain bench moe`: dispatch and combine cost against tokens per rank, at 2 ranks
(compare.py says what each rank runs).

Checked, or the bench fails (RuntimeError, exit status 1): the round trip through identity
experts returns every row and its gradient exactly, and the all-to-all bytes each rank's
ledger records for one forward and backward equal the formula
(`plan/expert_cost.py`): the counts, (ep - 1) E/ep int64, and twice the token
rows that leave the rank or arrive at it, for the counts the routing produced. Reported per
N: both algorithms' median times and the ratio pairwise / native with its spread, bytes
per rank, and the uniform-routing expectation 2 k N d e (ep - 1)/ep per pass beside it.
"""

from __future__ import annotations

import logging
from typing import Any

from paratrain.bench.harness.pairs import ratio_summary
from paratrain.bench.moe.compare import sweep
from paratrain.plan.expert_cost import counts_bytes, expected_token_bytes, token_bytes
from paratrain.spawn import run_ranks

log = logging.getLogger(__name__)
WORLD = 2  # on 2 cores only 2-rank timings mean anything
ELEM = 4  # float32 rows


def tokens_sweep(flag: str) -> list[int]:
    try:
        values = [int(v) for v in flag.split(",") if v.strip()]
    except ValueError:
        raise ValueError(
            f"--tokens {flag!r}: comma-separated whole numbers, e.g. 256,1024"
        ) from None
    if not values or min(values) < 1:
        raise ValueError(f"--tokens {flag!r}: every value must be at least 1")
    return values


def run_moe_bench(
    tokens: list[int], d_model: int, experts: int, top_k: int, pairs: int
) -> dict[str, Any]:
    if d_model < 1 or experts % WORLD or not 1 <= top_k <= experts:
        raise ValueError(
            f"--d-model {d_model}, --experts {experts}, --top-k {top_k}: need d_model >= 1, "
            f"experts a multiple of {WORLD}, 1 <= top_k <= experts"
        )
    if pairs < 2:
        raise ValueError(f"--pairs {pairs}: need at least 2 for a median")
    per_rank = run_ranks(sweep, WORLD, tokens, d_model, experts, top_k, pairs, timeout=1800)
    rows = [
        summarize(n, [r[i] for r in per_rank], d_model, experts, top_k)
        for i, n in enumerate(tokens)
    ]
    log.info(
        "expert dispatch and combine, ExpertParallel with identity experts, %d experts over "
        "ep=%d gloo ranks, top-%d uniform routing, rows of %d float32; ours: pairwise "
        "all-to-all on send/recv; peer: gloo's all_to_all_single",
        experts, WORLD, top_k, d_model,
    )  # fmt: skip
    for r in rows:
        log.info(
            "N=%d tokens per rank: pairwise %.5f s, native %.5f s, ratio %.3f (IQR %.3f-%.3f); "
            "%s B per rank per forward+backward (ledger = formula; uniform expectation %s B)",
            r["tokens"], r["ours_step_s"], r["torch_step_s"], r["ratio"], r["ratio_q1"],
            r["ratio_q3"], f"{r['bytes_per_rank']:,}", f"{r['uniform_bytes']:,.0f}",
        )  # fmt: skip
    return {"world": WORLD, "d_model": d_model, "experts": experts, "top_k": top_k, "sweep": rows}


def summarize(n: int, ranks: list[dict[str, Any]], d: int, experts: int, k: int) -> dict[str, Any]:
    for rank, r in enumerate(ranks):
        broken = [algo for algo, ok in r["exact"].items() if not ok]
        if broken:
            raise RuntimeError(f"N={n} {broken}: the round trip changed rows on rank {rank}")
        want = counts_bytes(experts, WORLD) + 2 * token_bytes(r["sends"], r["recvs"], rank, d, ELEM)
        for algo, got in r["sent"].items():
            if got != want:
                raise RuntimeError(
                    f"N={n} {algo}: rank {rank} sent {got} B, the formula says {want}"
                )
    steps = range(len(ranks[0]["rows"]))
    ours = [max(r["rows"][i][0] for r in ranks) for i in steps]
    peer = [max(r["rows"][i][1] for r in ranks) for i in steps]
    return {
        "tokens": n,
        **ratio_summary(ours, peer),
        "bytes_per_rank": max(r["sent"]["native"] for r in ranks),
        "uniform_bytes": counts_bytes(experts, WORLD)
        + 2 * expected_token_bytes(n, k, WORLD, d, ELEM),
    }
