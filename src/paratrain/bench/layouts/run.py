"""`paratrain bench layouts`: every 8-rank layout of our GPT side by side.

For each (dp, pp, tp, zero) the same model, data and global batch train for a few steps
in 8 gloo processes. Reported per layout: the median step time (8 processes on this
machine's cores: oversubscribed, so only a rough relative measure), bytes sent per rank
per step by group (from the ledger, deterministic) and model-state bytes per rank (what
the rank actually holds, by kind), as maxima over ranks.
"""

from __future__ import annotations

import logging
import statistics
from typing import Any

from paratrain.config import RunConfig
from paratrain.data.tokens import load_tokens
from paratrain.mesh import Mesh
from paratrain.spawn import run_ranks
from paratrain.train.loop import train
from paratrain.validate import resolve_and_check

log = logging.getLogger(__name__)
WORLD = 8
# (dp, pp, tp, zero, schedule)
LAYOUTS = [
    (8, 1, 1, 0, "1f1b"),
    (8, 1, 1, 1, "1f1b"),
    (8, 1, 1, 2, "1f1b"),
    (8, 1, 1, 3, "1f1b"),
    (4, 1, 2, 0, "1f1b"),
    (2, 1, 4, 0, "1f1b"),
    (4, 2, 1, 0, "1f1b"),
    (2, 4, 1, 0, "1f1b"),
    (2, 2, 2, 0, "1f1b"),
    (2, 2, 2, 1, "1f1b"),
    (2, 2, 2, 0, "interleaved"),
    (1, 2, 4, 0, "gpipe"),
]
GROUPS = ("dp", "tp", "pp")


def layout_config(dp: int, pp: int, tp: int, zero: int, schedule: str, steps: int) -> RunConfig:
    cfg = RunConfig()
    p, t = cfg.parallel, cfg.train
    p.nproc, p.dp, p.pp, p.tp, p.zero, p.schedule = WORLD, dp, pp, tp, zero, schedule
    p.chunks = 2 if schedule == "interleaved" else 1
    t.steps, t.global_batch, t.micro_batch, t.val_batches, t.warmup_steps = steps, 32, 2, 0, 1
    return resolve_and_check(cfg, WORLD)


def measure(rank: int, world: int, steps: int) -> list[dict[str, Any]]:
    data = load_tokens("")
    out = []
    for layout in LAYOUTS:
        dp, pp, tp = layout[:3]
        mesh = Mesh.build(dp=dp, pp=pp, tp=tp)
        marks: list[dict[str, int]] = []

        def on_step(_m: Any, mesh: Mesh = mesh, marks: list = marks) -> None:
            marks.append({g: mesh.ledger.bytes_sent(group=g) for g in GROUPS})

        result = train(layout_config(*layout, steps), mesh, data, on_step=on_step)
        per_step = {g: (marks[-1][g] - marks[0][g]) // (len(marks) - 1) for g in GROUPS}
        state = result.extra["model_state_bytes"]  # at the last step's end
        times = [m.step_s for m in result.metrics[1:]]
        out.append(
            {
                "sent": per_step,
                "state": state,
                "step_s": statistics.median(times),
                "loss": result.metrics[-1].loss,
            }
        )
        mesh.close()
    return out


def run_layouts_bench(steps: int = 4) -> dict[str, Any]:
    if steps < 3:
        raise ValueError(f"--steps {steps}: need at least 3 (one warm-up, two measured)")
    per_rank = run_ranks(measure, WORLD, steps, timeout=3600)
    rows = []
    header = (
        f"{'layout':<22}{'step s':>8}{'dp MB':>9}{'tp MB':>9}{'pp MB':>9}"
        f"{'state MB':>10}{'loss':>8}"
    )
    log.info(
        "8 ranks on this machine's cores (oversubscribed: times are rough); MB = 1e6 "
        "bytes per rank per step (sent) and held (state), maxima over ranks"
    )
    log.info(header)
    for i, (dp, pp, tp, zero, schedule) in enumerate(LAYOUTS):
        ranks = [r[i] for r in per_rank]
        name = f"dp{dp} pp{pp} tp{tp} z{zero}" + (f" {schedule}" if pp > 1 else "")
        row = {
            "layout": name,
            "dp": dp,
            "pp": pp,
            "tp": tp,
            "zero": zero,
            "schedule": schedule,
            "step_s": max(r["step_s"] for r in ranks),
            "sent_bytes_per_rank": {g: max(r["sent"][g] for r in ranks) for g in GROUPS},
            "model_state_bytes_per_rank": max(sum(r["state"].values()) for r in ranks),
            "state_by_kind_rank0": ranks[0]["state"],
            "final_loss": ranks[0]["loss"],
        }
        rows.append(row)
        sent = row["sent_bytes_per_rank"]
        log.info(
            f"{name:<22}{row['step_s']:>8.3f}{sent['dp'] / 1e6:>9.2f}{sent['tp'] / 1e6:>9.2f}"
            f"{sent['pp'] / 1e6:>9.2f}{row['model_state_bytes_per_rank'] / 1e6:>10.2f}"
            f"{row['final_loss']:>8.3f}"
        )
    return {"world_size": WORLD, "steps": steps, "layouts": rows}
