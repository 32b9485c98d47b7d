"""`paratrain bench zero`'s report: ratios and spread, the loss check, bytes, the PNG."""

from __future__ import annotations

import logging
from typing import Any

from paratrain.bench.harness.pairs import check_mean_losses, ratio_summary
from paratrain.bench.zero.compare import DTYPE, LOSS_RTOL
from paratrain.bench.zero.formulas import formula_comm, formula_state, scalar_bytes
from paratrain.bench.zero.peer import KINDS, PEERS, STATE_KINDS

log = logging.getLogger(__name__)
NOTES = {
    2: "FSDP2 with reshard_after_forward=False reshards after backward: at the step "
    "boundary it holds 16N/k, below ZeRO-2's 4N + 12N/k; it is the peer for traffic "
    "(one parameter all-gather per step), not for memory",
    3: "FSDP2 does not reshard the root after forward, so it gathers the root unit once "
    "per step where we gather every unit twice",
    "hsdp": "ZeRO-3 in 2 replica groups against FSDP2 on a (replicate, shard) mesh; at dp 2 "
    "a replica group is one rank, so neither side shards: both all-reduce the gradient "
    "(--dp 4 shards over 2; its bytes are exact, its times on 2 cores mean little)",
}


def _state(kinds: dict[str, int]) -> int:
    """Model-state bytes: every kind but `other` (step counters, buffers)."""
    return sum(kinds.get(k, 0) for k in STATE_KINDS)


def check_stage_losses(stage: int | str, results: list[dict]) -> float:
    """The largest relative loss difference over the steps; RuntimeError above LOSS_RTOL."""
    return check_mean_losses([r["losses"] for r in results], LOSS_RTOL, f"stage {stage}: ")


def summarize(
    zero: int, dp: int, results: list[dict], n_params: int, replicas: int = 1
) -> dict[str, Any]:
    """One row's JSON entry from every rank's result; raises if the losses differ. A row
    is a ZeRO stage, or with `replicas` > 1 ZeRO-3 in replica groups ("hsdp")."""
    stage = "hsdp" if replicas > 1 else zero
    worst = check_stage_losses(stage, results)
    formula = formula_state(n_params, zero, dp, replicas=replicas)
    times = results[0]["times"]  # rank 0's clock; both ranks wait on the same collectives
    ours_sent = [sum(r["ours_sent"].values()) for r in results]
    torch_sent = [sum(r["torch_sent"].values()) for r in results]
    return {
        "stage": stage,
        "zero": zero,
        "replicas": replicas,
        "dp": dp,
        "dtype": DTYPE,
        **ratio_summary([o for o, _ in times], [p for _, p in times]),
        "params": n_params,
        "model_state_bytes_per_rank": [_state(r["ours_bytes"]) for r in results],
        "formula_bytes_per_rank": formula["total"],
        "comm_bytes_per_rank_per_step": max(ours_sent),
        "max_param_diff": max(r["diff"] for r in results),
        "peer": PEERS[stage],
        "note": NOTES.get(stage, ""),
        "padding_bytes_per_rank": [r["ours_bytes"].get("padding", 0) for r in results],
        "torch_model_state_bytes_per_rank": [_state(r["torch_bytes"]) for r in results],
        "state_by_kind_per_rank": [r["ours_bytes"] for r in results],
        "torch_state_by_kind_per_rank": [r["torch_bytes"] for r in results],
        "formula_by_kind": formula,
        "comm_bytes_by_rank": ours_sent,
        "comm_bytes_by_op": results[0]["ours_sent"],
        "comm_formula_bytes": formula_comm(n_params, zero, dp, replicas),
        "comm_scalar_bytes_by_rank": scalar_bytes(zero, dp, replicas),
        "torch_comm_bytes_per_rank_per_step": max(torch_sent),
        "torch_comm_bytes_by_op": results[0]["torch_sent"],
        "torch_comm_norm_bytes_by_op": results[0]["torch_norm_sent"],
        "torch_comm_counted": "c10d and functional collectives at the dispatcher, sized with "
        "our ring formulas; not in our ledger",
        "torch_comm_unsized": results[0]["torch_unsized"],
        "loss_rtol": LOSS_RTOL,
        "max_loss_rel_diff": worst,
    }


def log_summary(e: dict[str, Any]) -> None:
    mib = 2**20
    z = e["stage"]
    log.info(
        "stage %s: median step ours %.4f s, torch %.4f s; ratio median %.3f (IQR %.3f-%.3f, "
        "range %.3f-%.3f) over %d pairs; losses within %.1e (tolerance %.0e); "
        "max parameter difference %.2e",
        z,
        e["ours_step_s"],
        e["torch_step_s"],
        e["ratio"],
        e["ratio_q1"],
        e["ratio_q3"],
        e["ratio_min"],
        e["ratio_max"],
        e["pairs"],
        e["max_loss_rel_diff"],
        e["loss_rtol"],
        e["max_param_diff"],
    )
    log.info(
        "stage %s: model state per rank (MiB) ours %s (padding %s), torch %s, "
        "formula %.3f (N = %d, k = %d)",
        z,
        " / ".join(f"{b / mib:.3f}" for b in e["model_state_bytes_per_rank"]),
        " / ".join(f"{b / mib:.3f}" for b in e["padding_bytes_per_rank"]),
        " / ".join(f"{b / mib:.3f}" for b in e["torch_model_state_bytes_per_rank"]),
        e["formula_bytes_per_rank"] / mib,
        e["params"],
        e["dp"],
    )
    log.info(
        "stage %s: bytes sent per rank per step ours %s %s (ledger) = paper %d + our step's "
        "scalars %s ((loss, tokens)%s, float64); torch %d %s, of which its gradient norm %s "
        "(counted at the dispatcher, not by our ledger)",
        z, " / ".join(str(b) for b in e["comm_bytes_by_rank"]), e["comm_bytes_by_op"],
        e["comm_formula_bytes"], " / ".join(str(b) for b in e["comm_scalar_bytes_by_rank"]),
        " and the gradient-norm squares" if z else "", e["torch_comm_bytes_per_rank_per_step"],
        e["torch_comm_bytes_by_op"], e["torch_comm_norm_bytes_by_op"],
    )  # fmt: skip
    if e["note"]:
        log.info("stage %s: %s", z, e["note"])


def plot_state_bytes(entries: list[dict[str, Any]], path: str) -> None:
    """Stacked bars: model-state MiB on rank 0 by kind; ours, torch, formula per stage."""
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = []
    for e in entries:
        z = e["stage"]
        bars.append((f"stage {z}\nours", e["state_by_kind_per_rank"][0]))
        bars.append((f"stage {z}\ntorch", e["torch_state_by_kind_per_rank"][0]))
        bars.append((f"stage {z}\nformula", e["formula_by_kind"]))
    fig, ax = plt.subplots(figsize=(0.9 * len(bars) + 2, 4.8))
    bottoms = [0.0] * len(bars)
    for kind in KINDS[:-1]:
        heights = [kinds.get(kind, 0) / 2**20 for _, kinds in bars]
        if any(heights):
            ax.bar(range(len(bars)), heights, bottom=bottoms, label=kind)
            bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    for x, top in enumerate(bottoms):
        ax.annotate(f"{top:.2f}", (x, top), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(bars)), [label for label, _ in bars], fontsize=7)
    ax.set_ylabel("MiB on rank 0 at the step boundary")
    e = entries[0]
    ax.set_title(
        f"Model state per rank, {e['dtype']} AdamW, k = {e['dp']}, N = {e['params']:,}\n"
        "formula: 16N, 8N+8N/k, 4N+12N/k, 16N/k (stage 2's torch peer, FSDP2 without "
        "reshard after forward: 16N/k)",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
