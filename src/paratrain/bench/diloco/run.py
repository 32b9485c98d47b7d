"""`paratrain bench diloco`: DiLoCo's step time against data parallelism's as the link
between replica groups slows (docs/diloco.md).

At 2 ranks, 2 replica groups of one rank, ZeRO-1, on `paratrain train`'s default model and
data, five ways of training, each through train/loop.py's whole loop: synchronous HSDP
(every step all-reduces the gradient across the groups), the same with that all-reduce in
int8 with error feedback (--compress int8, docs/compression.md), data parallelism with
PowerSGD at rank 4 (one group of 2 ranks without ZeRO: PowerSGD needs whole matrices),
DiLoCo (an outer step every --sync-every steps) and DiLoCo with int8 outer gradients.
Every group that spans the two ranks is slowed (dp, and dp_replicate where there are
groups; CommOptions: a latency per message step and a bandwidth): the gradients' or outer
steps' traffic and the loss's and norm's scalars alike. For each link the runs alternate,
--pairs times, and the bench reports each way's mean seconds per step (the outer steps'
cost spread over the run) and median with its quartiles (over the runs' own per-step
times, the first step left out), the bytes each rank sent per step on average in the group
its gradients or outer steps cross (dp_replicate; dp for PowerSGD, with the first step's
broadcast and the scalars), and the final losses, which differ by design (different
algorithms: recorded, not compared).
"""

from __future__ import annotations

import copy
import logging
import statistics
from dataclasses import replace
from typing import Any

import torch

from paratrain.config import RunConfig
from paratrain.data.tokens import TokenData, load_tokens
from paratrain.spawn import run_ranks
from paratrain.validate import resolve_and_check

log = logging.getLogger(__name__)
WORLD = 2
WAYS: dict[str, dict[str, object]] = {  # name: settings on top of HSDP's 2 groups of 1
    "dp (HSDP)": {},
    "dp int8": {"compress": "int8"},
    "dp powersgd": {"compress": "powersgd", "compress_rank": 4, "replicas": 1, "zero": 0},
    "diloco": {"dp_mode": "diloco"},
    "diloco int8": {"dp_mode": "diloco", "outer_dtype": "int8"},
}


def _train_one(rank: int, world: int, cfg: RunConfig, data: TokenData, link: tuple) -> dict:
    from paratrain.comm import CommOptions, Ledger
    from paratrain.mesh import Mesh
    from paratrain.train.loop import train

    torch.set_num_threads(1)
    ledger = Ledger()
    replicas = cfg.parallel.replicas
    mesh = Mesh.build(dp=WORLD, replicas=replicas, ledger=ledger, options=CommOptions())
    names = ["dp", "dp_replicate"] if replicas > 1 else ["dp"]  # groups across the link
    for name in names:
        group = mesh.group(name)
        group.options = replace(group.options, link_latency_s=link[0], link_bandwidth_Bps=link[1])
    result = train(cfg, mesh, data)
    mesh.close()
    steps = [m.step_s for m in result.metrics[1:]]
    gradients = names[-1]  # the group the gradients or outer steps cross in
    sent = ledger.bytes_sent(group=gradients) / max(1, len(result.metrics))
    return {"step_s": steps, "sent": sent, "loss": result.metrics[-1].loss}


def one_link(latency: float | None, bandwidth: float | None) -> list[tuple[float, float]] | None:
    """--link-latency / --link-bandwidth: that one link (an unset one: no limit), or None
    for the sweep."""
    if latency is None and bandwidth is None:
        return None
    for flag, value in (("--link-latency", latency), ("--link-bandwidth", bandwidth)):
        if value is not None and not value >= 0:
            raise ValueError(f"{flag} {value}: must be 0 or more")
    return [(latency or 0.0, bandwidth or 0.0)]


def run_diloco_bench(
    pairs: int = 3,
    steps: int = 40,
    sync_every: int = 10,
    links: list[tuple[float, float]] | None = None,
    base: RunConfig | None = None,
    data: TokenData | None = None,
) -> dict[str, Any]:
    """`links`: (latency in seconds per message step, bandwidth in bytes/s; 0: no limit);
    `base`: the model and batch (default: `paratrain train`'s); `data`: the tokens
    (default: the embedded default data)."""
    links = links or [(0.0, 0.0), (1e-3, 1e9), (2e-3, 1.25e8), (5e-3, 2e7)]  # 1.25e8: 1 Gbit/s
    data = data or load_tokens("")
    base = copy.deepcopy(base or RunConfig())
    p, t = base.parallel, base.train
    p.nproc, p.dp, p.replicas, p.zero, p.sync_every = WORLD, WORLD, WORLD, 1, sync_every
    t.steps, t.val_batches, t.checkpoint_every = steps, 0, 0
    configs = {}
    for name, settings in WAYS.items():
        cfg = copy.deepcopy(base)
        for key, value in settings.items():
            setattr(cfg.parallel, key, value)
        if cfg.parallel.dp_mode != "diloco":
            cfg.parallel.sync_every = RunConfig().parallel.sync_every  # no effect: default
        configs[name] = resolve_and_check(cfg, WORLD)
    out: dict[str, Any] = {"steps": steps, "sync_every": sync_every, "pairs": pairs, "links": []}
    for latency, bandwidth in links:
        times: dict[str, list[float]] = {name: [] for name in WAYS}
        row: dict[str, Any] = {"latency_s": latency, "bandwidth_Bps": bandwidth}
        for _ in range(pairs):
            for name, cfg in configs.items():
                ranks = run_ranks(_train_one, WORLD, cfg, data, (latency, bandwidth))
                times[name] += ranks[0]["step_s"]
                row[name] = {"sent_per_step": ranks[0]["sent"], "loss": ranks[0]["loss"]}
        for name in WAYS:
            q, mean = statistics.quantiles(times[name], n=4), statistics.fmean(times[name])
            row[name] |= {"median_s": statistics.median(times[name]), "q1_s": q[0], "q3_s": q[2]}
            row[name]["mean_s"] = mean  # the outer steps' cost spread over the run's steps
        out["links"].append(row)
        log.info("%s", _line(row))
    return out


def _line(row: dict[str, Any]) -> str:
    bw = row["bandwidth_Bps"]
    link = f"latency {1e3 * row['latency_s']:.0f} ms/step, " + (
        f"{bw / 1e6:.0f} MB/s" if bw else "unlimited"
    )
    ways = "; ".join(
        f"{name} mean {1e3 * row[name]['mean_s']:.1f} ms, median {1e3 * row[name]['median_s']:.1f}"
        f" [{1e3 * row[name]['q1_s']:.1f}-{1e3 * row[name]['q3_s']:.1f}], "
        f"{row[name]['sent_per_step'] / 1e6:.3f} MB/step, "
        f"loss {row[name]['loss']:.4f}"
        for name in WAYS
    )
    return f"link {link}: {ways}"
