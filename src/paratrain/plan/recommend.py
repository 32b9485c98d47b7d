"""Search the layouts that fit, pick one by the seeds' rule, and warn where it may be slow.

The rule (seeds, section 9.2.5 "三套接口的选择判据" and the 9.2.4 one-line criterion; the
3D layout of seeds' FAQ Q20 and Megatron-LM, arXiv:2104.04473, section 3.3):
  1. the model states and activations fit as plain DP: use DP;
  2. slightly over: ZeRO-1, else ZeRO-2 (same traffic as DP, less memory; with K > 1
     micro-batches that holds for Workload.zero2_accumulate "shard", the default, at
     K-fold gradient traffic, while "full" holds the whole gradient beside the shard, at
     its peak more than ZeRO-1: memory.py);
  3. far over: ZeRO-3 / FSDP;
  4. still over: tensor parallel, only within a node;
  5. still over: context parallel, the sequence split over cp ranks (it divides the
     activations, not the model states: long sequences; not a seeds' tier);
  6. then pipeline stages across nodes.
Within a tier the smallest degrees win, then the shortest step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypedDict

from paratrain.plan.cluster import GB, ClusterSpec
from paratrain.plan.estimate import Estimate, estimate
from paratrain.plan.layout import SCHEDULES, Layout, Workload
from paratrain.plan.model import ModelSpec

SYNC_VS_ASYNC = (
    "Synchronous data parallelism (what every layout here assumes) averages the gradients "
    "of all replicas before each update, so training equals one large-batch step on one "
    "device, but every step waits for the slowest GPU. Asynchronous data parallelism lets "
    "each worker update without waiting, which removes that wait but applies gradients "
    "computed on stale parameters and can lose accuracy; the seeds suggest synchronous "
    "training for small clusters and accuracy-sensitive work."
)
TIERS = (
    "plain data parallel fits",
    "slightly over: ZeRO-1/2 shards the optimizer (and gradients)",
    "far over: ZeRO-3 / FSDP shards everything",
    "still over: tensor parallel within a node",
    "still over: context parallel splits the sequence",
    "still over: pipeline stages across nodes",
)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(
    cluster: ClusterSpec,
    schedule: str | None = None,
    chunks: int = 1,
    fixed: dict[str, int | None] | None = None,
    experts: int = 0,
    cp_method: str = "ring",
) -> list[Layout]:
    """Every tp x cp x pp x dp x ZeRO x schedule for the cluster, restricted by `fixed`
    degrees (and HSDP's `replicas`); for a mixture of `experts` experts, every ep that
    divides dp * cp and them.

    ZeRO needs dp * cp > 1 (on one rank it is plain DP). The interleaved schedule uses
    `chunks` (2 when not given). Layouts that cannot run are kept: the planner reports why.
    """
    given = {k: v for k, v in (fixed or {}).items() if v is not None}
    out = []
    for tp in divisors(cluster.gpus):
        for cp in divisors(cluster.gpus // tp):
            for pp in divisors(cluster.gpus // (tp * cp)):
                dp = cluster.gpus // (tp * cp * pp)
                degrees = (("tp", tp), ("cp", cp), ("pp", pp), ("dp", dp))
                if any(given.get(a, v) != v for a, v in degrees):
                    continue
                shape = _Shape(dp=dp, tp=tp, pp=pp, cp=cp, cp_method=cp_method)
                out += _variants(shape, schedule, chunks, given, experts)
    return out


class _Shape(TypedDict):
    """A layout's degrees and cp method: the Layout fields every variant shares."""

    dp: int
    tp: int
    pp: int
    cp: int
    cp_method: str


def _variants(
    shape: _Shape, schedule: str | None, chunks: int, fixed: dict[str, int], experts: int
) -> list[Layout]:
    """One tp x cp x pp x dp shape under every ep, ZeRO stage and schedule; with `replicas`
    R > 1 (HSDP), only ZeRO 1-3, only where R divides dp and ep a replica group."""
    ranks = shape["dp"] * shape["cp"]
    replicas = fixed.get("replicas", 1)
    eps = [e for e in divisors(ranks) if experts % e == 0] if experts else [1]
    eps = [fixed["ep"]] if "ep" in fixed else eps
    zeros = [fixed["zero"]] if "zero" in fixed else ([0, 1, 2, 3] if ranks > 1 else [0])
    if replicas > 1:
        if shape["dp"] % replicas:
            return []
        eps = [e for e in eps if (ranks // replicas) % e == 0]
        zeros = [z for z in zeros if z > 0]
    scheds = [""] if shape["pp"] == 1 else ([schedule] if schedule else list(SCHEDULES))
    out = []
    for ep in eps:
        if ranks % ep:
            continue
        for zero in zeros:
            for s in scheds:
                v = (chunks if chunks > 1 else 2) if s == "interleaved" else 1
                out.append(
                    Layout(**shape, ep=ep, zero=zero, schedule=s, chunks=v, replicas=replicas)
                )
    return out


def tier(layout: Layout) -> int:
    if layout.pp > 1:
        return 5
    if layout.cp > 1:
        return 4
    if layout.tp > 1:
        return 3
    return {0: 0, 1: 1, 2: 1, 3: 2}[layout.zero]


def choose(estimates: list[Estimate]) -> Estimate | None:
    """The seeds' rule over the layouts that fit."""
    fitting = [e for e in estimates if e.fits]
    if not fitting:
        return None

    def key(e: Estimate) -> tuple[int, int, int, int, int, int, float]:
        lay = e.layout
        step = e.time.total_s if e.time else float("inf")
        return (tier(lay), lay.pp, lay.tp, lay.cp, lay.ep, lay.zero, step)

    return min(fitting, key=key)


def explain(best: Estimate | None, estimates: list[Estimate], cluster: ClusterSpec) -> str:
    """One paragraph: which tier, why the tiers before it failed, what it costs."""
    cap = cluster.gpu_memory_bytes / GB
    rule = (
        "Rule (from the seeds): fits as plain DP -> DP; slightly over -> ZeRO-1/2; far over "
        "-> ZeRO-3/FSDP; then tensor parallel within a node; then context parallel (long "
        "sequences); then pipeline across nodes."
    )
    if best is None:
        return f"No layout fits in {cap:.0f} GB per GPU on {cluster.gpus} GPUs. {rule}"
    plain = [e for e in estimates if e.layout == Layout(dp=cluster.gpus)]
    lines = [rule]
    if plain and best.layout != plain[0].layout:
        lines.append(f"Plain DP on {cluster.gpus} GPUs is rejected: {plain[0].reason}.")
    lay = best.layout
    step = f", step {best.time.total_s:.3g} s" if best.time else ""
    lines.append(
        f"Recommended {lay.label} ({TIERS[tier(lay)]}): {best.memory_bytes / GB:.2f} of "
        f"{cap:.0f} GB per GPU, {best.comm_bytes / GB:.3g} GB sent per GPU per step{step}."
    )
    return " ".join(lines)


def warnings_for(e: Estimate, estimates: list[Estimate], cluster: ClusterSpec) -> list[str]:
    """The seeds' four cases where sharding makes training slower (section 9.2.4), and more."""
    out, lay = [], e.layout
    if lay.zero and 1 < lay.data_ranks <= 4:
        out.append(
            f"{lay.label}: ZeRO over only {lay.data_ranks} GPUs saves little memory and adds "
            "collective latency; compare the step time with ZeRO off"
        )
    unsharded = [x for x in estimates if x.layout.zero == 0 and x.fits]
    same = [x for x in unsharded if (x.layout.tp, x.layout.pp) == (lay.tp, lay.pp)]
    if lay.zero and same:
        out.append(f"{lay.label}: the model already fits without ZeRO; sharding only adds traffic")
    for c in e.comm:
        if c.link == "inter" and c.messages:
            per_msg = c.bytes / c.messages
            break_even = cluster.inter_latency_s * cluster.inter_bw
            if per_msg < break_even:
                out.append(
                    f"{lay.label}: {c.op} of {c.what} sends {c.messages} messages of "
                    f"{per_msg / 1e6:.3g} MB across nodes, below the {break_even / 1e6:.3g} MB "
                    "where latency equals transfer time: latency-bound"
                )
    if e.time and e.time.comm_s > e.time.compute_s:
        out.append(
            f"{lay.label}: communication {e.time.comm_s:.3g} s exceeds compute "
            f"{e.time.compute_s:.3g} s per step: too few tokens per GPU to hide it"
        )
    timed = [(x.time.total_s, x) for x in estimates if x.fits and x.time is not None]
    fastest = min(timed, key=lambda pair: pair[0], default=None)  # the first of equals
    if e.time and fastest and fastest[0] * 1.2 < e.time.total_s:
        out.append(
            f"{lay.label}: the rule picks by memory; {fastest[1].layout.label} also fits and its "
            f"step is {fastest[0]:.3g} s against {e.time.total_s:.3g} s"
        )
    if e.bubble and e.bubble > 0.2:
        out.append(
            f"{lay.label}: pipeline bubble {e.bubble:.0%}; K >= 4 x stages keeps it under 20%"
        )
    return out


@dataclass
class Plan:
    model: ModelSpec
    cluster: ClusterSpec
    workload: Workload
    estimates: list[Estimate]
    recommended: Estimate | None
    explanation: str
    warnings: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """The `--json` object: inputs, layouts, recommended, and the prose."""
        w = self.workload
        return {
            "inputs": {
                "model": {**self.model.__dict__, "params": self.model.params},
                "cluster": dict(self.cluster.__dict__),
                "workload": {
                    **{k: v for k, v in w.__dict__.items() if k != "precision"},
                    "precision": w.precision.name,
                    "state_bytes_per_param": w.state_bytes_per_param,
                },
            },
            "layouts": [e.as_dict() for e in self.estimates],
            "recommended": self.recommended.as_dict() if self.recommended else None,
            "explanation": self.explanation,
            "warnings": self.warnings,
            "sync_vs_async": SYNC_VS_ASYNC,
        }


def plan(
    model: ModelSpec,
    cluster: ClusterSpec,
    workload: Workload,
    layouts: list[Layout] | None = None,
) -> Plan:
    """Evaluate the layouts (default: every candidate) and recommend one."""
    if layouts is None:
        layouts = candidate_layouts(cluster, experts=model.num_experts)
    if not layouts:
        raise ValueError(f"no layout matches the given degrees on {cluster.gpus} GPUs")
    estimates = [estimate(model, cluster, workload, lay) for lay in layouts]
    best = choose(estimates)
    warns = warnings_for(best, estimates, cluster) if best else []
    if len(estimates) == 1 and best is None:
        warns = warnings_for(estimates[0], estimates, cluster)
    return Plan(model, cluster, workload, estimates, best, explain(best, estimates, cluster), warns)
