"""`paratrain bench pp`: our pipeline schedules against `torch.distributed.pipelining`.

For each schedule, 2 gloo ranks (1 thread each; on 2 cores only 2-rank timings mean
anything) run our `PipelineRuntime` and torch's schedule class on copies of the same GPT
with the same split, micro-batch count and batches, alternating which goes first for
`pairs` pairs (pp_ranks.py). Reported per schedule: the medians of both step times, the
median of the pairwise ratios ours / torch with quartiles and range, our measured bubble
(per stage, from the runtime's own timestamps, median over pairs) beside the simulated one
and the formula, and our peak in-flight activations per stage. The bench fails if the two
sides' losses differ by more than LOSS_RTOL at any step: then the runs are not comparable.
"""

from __future__ import annotations

import logging
import math
import statistics
from pathlib import Path
from typing import Any

import torch

from paratrain.bench.harness.spawn import run_ranks
from paratrain.bench.pp.compare import PEER, compare_schedules
from paratrain.config import RunConfig
from paratrain.measure.schedule_command import bubble_formula
from paratrain.measure.timeline import spans_from_traces, write_chrome_trace, write_gantt
from paratrain.parallel.pipeline import Costs, build_schedule, check_schedule
from paratrain.train.data import BatchSampler, load_tokens

log = logging.getLogger(__name__)
WORLD = 2
MICRO_BATCH = 2  # sequences per micro-batch: K = 8 gives the default global batch of 16
# Same weights, batches and arithmetic up to the order of float32 additions (torch divides
# the accumulated gradient by K, ours each micro-batch's loss), amplified a little by AdamW.
LOSS_RTOL = 1e-4


def peer_description(name: str, k: int) -> str:
    cls, v = PEER[name]
    stage = f"PipelineStage(chunk, stage_index=c*{WORLD}+rank, num_stages={WORLD * v})"
    return (
        f"torch.distributed.pipelining.{cls}({stage} x{v}, n_microbatches={k}, "
        "loss_fn=mean cross-entropy, scale_grads=True), step(return_outputs=False); "
        f"AdamW(foreach=True); gloo, {WORLD} ranks, 1 thread each"
    )


def _check_args(names: list[str], pairs: int, k: int) -> None:
    unknown = [n for n in names if n not in PEER]
    if unknown or not names:
        raise ValueError(f"--schedules {','.join(names)!r}; valid: {', '.join(PEER)}")
    if pairs < 2:
        raise ValueError(f"--pairs {pairs}: need at least 2 pairs for quartiles")
    for name in names:
        build_schedule(name, WORLD, k, PEER[name][1])  # K valid for every schedule asked


def _batches(count: int, k: int, data: str) -> list[torch.Tensor]:
    """The first `count` global batches of `data` ('' = the default corpus), K x b rows."""
    t = RunConfig().train
    sampler = BatchSampler(load_tokens(data).train, t.seq_len, k * MICRO_BATCH, t.seed)
    return [sampler.global_batch_at(step) for step in range(count)]


def summarise(name: str, k: int, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One schedule's entry of the JSON result from every rank's rows."""
    last = per_rank[-1]  # the last stage holds the loss on both sides
    for step, (ours, peer) in enumerate([last["warmup_losses"]] + [r[2:] for r in last["rows"]]):
        if not math.isclose(ours, peer, rel_tol=LOSS_RTOL):
            raise RuntimeError(
                f"{name}: losses differ at step {step} (ours {ours:.6f}, torch {peer:.6f}, "
                f"tolerance {LOSS_RTOL:g} relative): the runs are not comparable"
            )
    loss_diff = max(abs(r[2] - r[3]) / abs(r[3]) for r in last["rows"])
    # A pipeline step ends when its slowest stage ends: per pair, the slower rank's time.
    ours = [max(r["rows"][i][0] for r in per_rank) for i in range(len(last["rows"]))]
    peer = [max(r["rows"][i][1] for r in per_rank) for i in range(len(last["rows"]))]
    ratios = sorted(o / p for o, p in zip(ours, peer, strict=True))
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    v = PEER[name][1]
    bubbles = [statistics.median(r["bubbles"]) for r in per_rank]
    sim = check_schedule(build_schedule(name, WORLD, k, v), Costs(forward=1.0, backward=2.0))
    return {
        "schedule": name,
        "peer": PEER[name][0],
        "stages": WORLD,
        "chunks": v,
        "microbatches": k,
        "micro_batch": MICRO_BATCH,
        "pairs": len(ratios),
        "ours_step_s": statistics.median(ours),
        "torch_step_s": statistics.median(peer),
        "ratio": statistics.median(ratios),
        "ratio_q1": q1,
        "ratio_q3": q3,
        "ratio_min": ratios[0],
        "ratio_max": ratios[-1],
        "bubble_measured": statistics.fmean(bubbles),
        "bubble_measured_per_stage": bubbles,
        "bubble_simulated": sim.bubble_fraction(),  # backward = 2 x forward
        "bubble_formula": bubble_formula(name, WORLD, k, v, 2.0)[0],
        "peak_in_flight": [r["peak_in_flight"] for r in per_rank],
        "peak_in_flight_simulated": list(sim.peak_in_flight),
        "max_loss_rel_diff": loss_diff,
    }


def _draw(entry: dict[str, Any], per_rank: list[dict[str, Any]], out: Path) -> None:
    traces = [r["trace"] for r in per_rank]
    spans = spans_from_traces(traces)
    title = (
        f"{entry['schedule']} (ours, measured): S={WORLD} K={entry['microbatches']} "
        f"v={entry['chunks']}, last of {entry['pairs']} pairs"
    )
    idle = [t.bubble_fraction() for t in traces]
    png = out / f"pp-{entry['schedule']}.png"
    entry["gantt"] = str(write_gantt(spans, png, WORLD, entry["chunks"], title, idle))
    with_comm = spans_from_traces(traces, include_comm=True)
    trace_path = out / f"pp-{entry['schedule']}.trace.json"
    entry["trace"] = str(write_chrome_trace(with_comm, trace_path, WORLD, entry["chunks"]))


def run_pp_bench(
    names: list[str],
    pairs: int = 20,
    microbatches: int = 8,
    out: str | None = "runs/bench-pp",
    data: str = "",
) -> dict[str, Any]:
    """Run every schedule in `names` against torch's; the result of `--json`.

    The batches are read once here and handed to the ranks, so both sides and all stages
    see the same ones; `data` is `load_tokens`'s path (tests pass a small file to skip
    reading the default corpus).
    """
    _check_args(names, pairs, microbatches)
    torch.set_num_threads(1)
    batches = _batches(pairs + 1, microbatches, data)
    for name in names:
        log.info("%s vs %s", name, peer_description(name, microbatches))
    by_rank = run_ranks(compare_schedules, WORLD, names, batches, microbatches, timeout=3600)
    results = []
    for name in names:
        per_rank = [r[name] for r in by_rank]
        entry = summarise(name, microbatches, per_rank)
        if out:
            _draw(entry, per_rank, Path(out))
        results.append(entry)
        log.info(
            "%s: median step ours %.4f s, torch %.4f s; ratio %.3f (IQR %.3f-%.3f, range "
            "%.3f-%.3f, %d pairs); bubble measured %s (simulated %.3f, formula %.3f); peak "
            "in-flight %s; losses agree to %.1e",
            name,
            entry["ours_step_s"],
            entry["torch_step_s"],
            entry["ratio"],
            entry["ratio_q1"],
            entry["ratio_q3"],
            entry["ratio_min"],
            entry["ratio_max"],
            entry["pairs"],
            [round(b, 3) for b in entry["bubble_measured_per_stage"]],
            entry["bubble_simulated"],
            entry["bubble_formula"],
            entry["peak_in_flight"],
            entry["max_loss_rel_diff"],
        )
    log.info(_table(results))
    return {"schedules": results, "loss_rtol": LOSS_RTOL, "world_size": WORLD}


def _table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| schedule | torch peer | ours (s) | torch (s) | ratio [IQR] | bubble measured "
        "| simulated | peak in-flight |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for e in results:
        lines.append(
            f"| {e['schedule']} | {e['peer']} | {e['ours_step_s']:.4f} | "
            f"{e['torch_step_s']:.4f} | {e['ratio']:.3f} [{e['ratio_q1']:.3f}-"
            f"{e['ratio_q3']:.3f}] | {e['bubble_measured']:.3f} | {e['bubble_simulated']:.3f} "
            f"| {e['peak_in_flight']} |"
        )
    return "\n".join(lines)
