"""What `paratrain bench comm` shows: tables, the comparison with native, and the PNG plot."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from paratrain.bench.comm.fit import Fit, busbw_factor

COLORS = {"native": "black", "ring": "tab:blue", "tree": "tab:orange", "pairwise": "tab:green"}


def format_bytes(n: float) -> str:
    """1024 -> '1 KB', 67108864 -> '64 MB' (binary units, as the --sizes flag reads them)."""
    for unit, scale in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if n >= scale:
            value = n / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{n:.0f} B"


def format_time(t: float) -> str:
    if t < 1e-3:
        return f"{t * 1e6:.0f} us"
    return f"{t * 1e3:.2f} ms" if t < 1 else f"{t:.2f} s"


def format_table(rows: list[dict[str, Any]]) -> str:
    """One line per measurement. Bytes are the most any rank sent: by the ledger (and
    whether every rank's count equals the formula: `=` real bytes, `~` native, recorded
    from the formula), and on the wire (TCP payload acknowledged), with the wire over the
    ledger and the wire's excess over gloo's model (its preambles; `-` not modelled)."""
    head = (
        f"{'op':<15}{'algo':<7}{'size':>8}{'time':>11}{'algbw GB/s':>12}{'busbw GB/s':>12}"
        f"{'ledger/rank':>13}  {'bytes':<9}{'wire/rank':>13}{'wire/ledger':>12}"
        f"{'+ over gloo':>12}  why"
    )
    lines = [head]
    for r in rows:
        mark = "~" if r["bytes_counted"] == "formula" else "="
        ok = f"{mark} formula" if r["bytes_match"] else "DIFFER"
        ledger, on_wire = max(r["sent_bytes_per_rank"]), max(r["wire_sent_bytes_per_rank"])
        over = r["wire_overhead_bytes_per_rank"]
        extra = "-" if over is None else f"{max(over):,}" + ("" if r["wire_match"] else " NO")
        lines.append(
            f"{r['op']:<15}{r['algo']:<7}{format_bytes(r['bytes']):>8}"
            f"{format_time(r['time_s']):>11}{r['algbw_gbps']:>12.3f}{r['busbw_gbps']:>12.3f}"
            f"{ledger:>13,}  {ok:<9}{on_wire:>13,}{on_wire / max(ledger, 1):>12.3f}"
            f"{extra:>12}  {r['wire_note']}"
        )
    return "\n".join(lines)


def vs_native(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Time of each of our algorithms over native's, per op and world size, across sizes."""
    native = {
        (r["op"], r["world_size"], r["bytes"]): r["time_s"]
        for r in results
        if r["algo"] == "native"
    }
    groups: dict[tuple[str, str, int], list[tuple[int, float]]] = {}
    for r in results:
        key = (r["op"], r["world_size"], r["bytes"])
        if r["algo"] != "native" and key in native:
            ratio = r["time_s"] / native[key]
            groups.setdefault((r["op"], r["algo"], r["world_size"]), []).append((r["bytes"], ratio))
    out = []
    for (op, algo, world), pairs in groups.items():
        ratios = [q for _, q in pairs]
        out.append(
            {
                "op": op,
                "algo": algo,
                "world_size": world,
                "median_time_ratio": statistics.median(ratios),
                "smallest_size_ratio": min(pairs)[1],
                "largest_size_ratio": max(pairs)[1],
            }
        )
    return out


def format_fits(fits: list[Fit]) -> str:
    lines = [f"{'op':<15}{'algo':<7}{'alpha':>10}{'1/beta GB/s':>13}{'rel rms':>9}  fitted on"]
    for f in fits:
        bw = f"{1e-9 / f.beta_s_per_byte:.3f}" if f.beta_s_per_byte > 0 else "inf"
        over = " (oversubscribed)" if f.oversubscribed else ""
        worlds = ",".join(map(str, f.world_sizes))
        lines.append(
            f"{f.op:<15}{f.algo:<7}{format_time(f.alpha_s):>10}{bw:>13}{f.rel_rms:>9.2f}  "
            f"{f.points} points, world {worlds}{over}"
        )
    return "\n".join(lines)


def format_predictions(preds: dict[str, list[dict[str, Any]]]) -> str:
    lines = []
    for name, what in (
        ("own_fits", "each algorithm's own alpha, beta"),
        ("ring_alpha_beta_for_both", "the ring's alpha, beta for both"),
    ):
        parts = []
        for p in preds.get(name, []):
            k, verdict = p["world_size"], p["tree_faster"]
            if verdict in ("below", "above"):
                parts.append(f"k={k}: {verdict} {format_bytes(p['crossover_bytes'])}")
            else:
                parts.append(f"k={k}: {verdict}")
        if parts:
            lines.append(f"tree all-reduce beats ring ({what}): " + "; ".join(parts))
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], fits: list[Fit], path: str | Path) -> Path:
    """Bus bandwidth against message size: a panel per (op, world size), a line per
    algorithm; dashed, what the alpha-beta fit predicts at that world size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = list(dict.fromkeys(r["op"] for r in results))
    worlds = sorted({r["world_size"] for r in results})
    fig, axes = plt.subplots(
        len(ops), len(worlds), figsize=(4.2 * len(worlds), 3.2 * len(ops)), squeeze=False
    )
    by_fit = {(f.op, f.algo): f for f in fits}
    for i, op in enumerate(ops):
        for j, world in enumerate(worlds):
            ax = axes[i][j]
            rows = [r for r in results if r["op"] == op and r["world_size"] == world]
            for algo in dict.fromkeys(r["algo"] for r in rows):
                mine = sorted((r for r in rows if r["algo"] == algo), key=lambda r: r["bytes"])
                sizes = [r["bytes"] for r in mine]
                ax.plot(
                    sizes, [r["busbw_gbps"] for r in mine], "o-", color=COLORS[algo], label=algo
                )
                fit = by_fit.get((op, algo))
                if fit is not None and fit.alpha_s + fit.beta_s_per_byte > 0:
                    factor = busbw_factor(op, world)
                    model = [s / fit.predict(world, s) / 1e9 * factor for s in sizes]
                    ax.plot(sizes, model, "--", color=COLORS[algo], alpha=0.5, linewidth=1)
            over = rows and rows[0]["oversubscribed"]
            ax.set_title(f"{op}, {world} ranks" + (" (oversubscribed)" if over else ""), fontsize=9)
            ax.set_xscale("log", base=2)
            ticks = sorted({r["bytes"] for r in rows})[::2]
            ax.set_xticks(ticks, [format_bytes(t) for t in ticks], fontsize=7)
            ax.minorticks_off()
            ax.set_yscale("log")
            ax.grid(True, alpha=0.3)
            if i == len(ops) - 1:
                ax.set_xlabel("message size")
            if j == 0:
                ax.set_ylabel("bus bandwidth (GB/s)")
            ax.legend(fontsize=7)
    fig.suptitle("paratrain bench comm: busbw (solid, measured) and alpha-beta fit (dashed)")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
