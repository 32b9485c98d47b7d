"""`paratrain bench zero`'s report: ratios and spread, the loss check, bytes, the PNG."""

from __future__ import annotations

import logging
import statistics
from typing import Any

from paratrain.bench.zero_peer import KINDS

log = logging.getLogger(__name__)


def _total(kinds: dict[str, int]) -> int:
    return sum(kinds.get(k, 0) for k in KINDS)


def summarize(
    variant: Any, results: list[dict], n_params: int, predicted: dict[str, int]
) -> dict[str, Any]:
    """One comparison's JSON entry from every rank's result; raises if the losses differ."""
    from paratrain.bench.zero import LOSS_RTOL, WORLD

    worst = 0.0
    for rank, r in enumerate(results):
        for step, (_, _, ours, peer) in enumerate(r["rows"]):
            rel = abs(ours - peer) / abs(peer)
            if rel > LOSS_RTOL:
                raise RuntimeError(
                    f"{variant.name}: losses differ on rank {rank} at pair {step} "
                    f"({ours} vs {peer}, relative {rel:.1e} > {LOSS_RTOL}): runs not comparable"
                )
            worst = max(worst, rel)
    rows = results[0]["rows"]  # rank 0's clock; both ranks wait on the same collectives
    ratios = sorted(o / p for o, p, _, _ in rows)
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    return {
        "variant": variant.name,
        "zero": variant.zero,
        "dp": WORLD,
        "dtype": "float32",
        "peer": variant.peer,
        "params": n_params,
        "pairs": len(rows),
        "ours_step_s": statistics.median(r[0] for r in rows),
        "torch_step_s": statistics.median(r[1] for r in rows),
        "ratio": statistics.median(ratios),
        "ratio_q1": q1,
        "ratio_q3": q3,
        "ratio_min": ratios[0],
        "ratio_max": ratios[-1],
        "ours_state_bytes": [_total(r["ours_bytes"]) for r in results],
        "torch_state_bytes": [_total(r["torch_bytes"]) for r in results],
        "predicted_state_bytes": predicted["total"],
        "ours_state_by_kind": [r["ours_bytes"] for r in results],
        "torch_state_by_kind": [r["torch_bytes"] for r in results],
        "predicted_by_kind": predicted,
        "max_loss_rel_diff": worst,
        "max_param_diff": max(r["diff"] for r in results),
    }


def log_summary(e: dict[str, Any]) -> None:
    mib = 2**20
    log.info(
        "%s: median step ours %.4f s, torch %.4f s; ratio median %.3f (IQR %.3f-%.3f, "
        "range %.3f-%.3f) over %d pairs; losses within %.1e; max parameter difference %.2e",
        e["variant"],
        e["ours_step_s"],
        e["torch_step_s"],
        e["ratio"],
        e["ratio_q1"],
        e["ratio_q3"],
        e["ratio_min"],
        e["ratio_max"],
        e["pairs"],
        e["max_loss_rel_diff"],
        e["max_param_diff"],
    )
    log.info(
        "%s: model state per rank (MiB) ours %s, torch %s, planner %.3f (N = %d)",
        e["variant"],
        " / ".join(f"{b / mib:.3f}" for b in e["ours_state_bytes"]),
        " / ".join(f"{b / mib:.3f}" for b in e["torch_state_bytes"]),
        e["predicted_state_bytes"] / mib,
        e["params"],
    )


def plot_state_bytes(entries: list[dict[str, Any]], path: str) -> None:
    """Stacked bars: model-state MiB on rank 0 by kind, ours / torch / planner per variant."""
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = []
    for e in entries:
        bars.append((f"{e['variant']}\nours", e["ours_state_by_kind"][0]))
        bars.append((f"{e['variant']}\ntorch", e["torch_state_by_kind"][0]))
        bars.append((f"{e['variant']}\nplanner", e["predicted_by_kind"]))
    fig, ax = plt.subplots(figsize=(1.1 * len(bars) + 2, 4.5))
    bottoms = [0.0] * len(bars)
    for kind in KINDS:
        heights = [kinds.get(kind, 0) / 2**20 for _, kinds in bars]
        if any(heights):
            ax.bar(range(len(bars)), heights, bottom=bottoms, label=kind)
            bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    ax.set_xticks(range(len(bars)), [label for label, _ in bars], fontsize=8)
    ax.set_ylabel("MiB on rank 0 at the step boundary")
    ax.set_title("Model state per rank, fp32 AdamW, 2 ranks (planner: 8N+8N/k, 4N+12N/k, 16N/k)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
