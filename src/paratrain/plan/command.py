"""`paratrain plan`: flags to specs, specs to a plan, the plan to a table, JSON and a chart.

Flags override presets: `--preset 7b --preset a100-80gb-nvlink300-ib25 --gpus 64`.
Every bad value raises ValueError naming it and what is valid; cli.main prints one line.
`--validate`'s measured runs are the benchmarks' (bench/planner/); the CLI passes them in,
so that the planner stays pure.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import replace

from paratrain.plan.cluster import (
    CLUSTER_PRESETS,
    DEFAULT_CLUSTER,
    GB,
    ClusterSpec,
    cluster_preset,
    cluster_with,
)
from paratrain.plan.layout import (
    ATTENTION,
    CP_METHODS,
    RECOMPUTE,
    SCHEDULES,
    ZERO2_ACCUMULATE,
    Workload,
    precision,
)
from paratrain.plan.model import MODEL_PRESETS, ModelSpec, model_preset, with_overrides
from paratrain.plan.recommend import Plan, candidate_layouts, plan
from paratrain.plan.report import chart, table

DEFAULT_MODEL = "7b"
DEFAULT_SEQ_LEN = 2048  # for a model given by its parameter count alone


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    presets = ", ".join([*MODEL_PRESETS, *CLUSTER_PRESETS])
    p.add_argument(
        "--preset",
        action="append",
        default=[],
        metavar="NAME",
        help=f"model or cluster preset, repeatable: {presets} "
        f"(default: {DEFAULT_MODEL}, {DEFAULT_CLUSTER})",
    )
    _model_arguments(p.add_argument_group("model (overrides the preset)"))
    _training_arguments(p.add_argument_group("training"))
    _cluster_arguments(p.add_argument_group("cluster (overrides the preset)"))
    _layout_arguments(p.add_argument_group("layout (evaluate one instead of searching)"))
    _output_arguments(p.add_argument_group("output"))


def _model_arguments(m: argparse._ArgumentGroup) -> None:
    m.add_argument("--params", type=float, help="parameter count N, e.g. 7e9")
    m.add_argument("--layers", type=int, help="transformer blocks")
    m.add_argument("--hidden", type=int, help="hidden size (d_model)")
    m.add_argument("--heads", type=int, help="attention heads")
    m.add_argument("--vocab", type=int, help="vocabulary size")
    m.add_argument(
        "--seq-len",
        type=int,
        help=f"tokens per sequence (default {DEFAULT_SEQ_LEN} with --params alone)",
    )
    m.add_argument("--experts", type=int, help="mixture of experts: experts per layer (llama)")
    m.add_argument("--top-k", type=int, help="experts per token")
    m.add_argument("--expert-ffn", type=int, help="each expert's inner width (default: ffn)")
    m.add_argument("--shared-ffn", type=int, help="a shared expert's inner width (0: none)")
    m.add_argument(
        "--capacity-factor", type=float, help="tokens per expert at most c x an even share"
    )


def _training_arguments(w: argparse._ArgumentGroup) -> None:
    w.add_argument(
        "--micro-batch", type=int, default=1, help="sequences per forward, b (default 1)"
    )
    w.add_argument("--global-batch", type=int, help="sequences per step, G (default 512)")
    w.add_argument("--microbatches", type=int, help="K = G / (b dp); alternative to G")
    w.add_argument("--precision", default="mixed", help="mixed (16 B/param with Adam), fp32, bf16")
    w.add_argument("--optimizer", default="adam", help="adam, sgd-momentum, sgd")
    w.add_argument(
        "--recompute", default="none", choices=RECOMPUTE, help="activation recomputation"
    )
    w.add_argument(
        "--activation-gb",
        type=float,
        help="activation GB per GPU, replacing the count (e.g. the seeds' 40)",
    )
    w.add_argument(
        "--overlap",
        type=float,
        default=0.0,
        help="fraction of data-parallel traffic hidden behind backward (default 0)",
    )
    w.add_argument(
        "--zero2-accumulate",
        default="shard",
        choices=ZERO2_ACCUMULATE,
        help="ZeRO-2 with K > 1 micro-batches, which option the search charges: shard (the "
        "runtime's default, DeepSpeed's: reduce-scatter every micro-batch, model state "
        "2N + 14N/k with mixed Adam, K x gradient traffic) or full (whole gradient held "
        "until the last micro-batch, one reduce-scatter); the table shows the other beside "
        "it (default shard)",
    )
    w.add_argument(
        "--attention",
        default="fused",
        choices=ATTENTION,
        help="fused: the s x s scores stay on chip (our runtime); scores: they go through "
        "memory, timed at --memory-bw-gbs (Megatron-LM in 2021) (default fused)",
    )
    w.add_argument(
        "--moe-imbalance",
        type=float,
        default=1.0,
        help="the router's load on the busiest expert-parallel rank over the mean, >= 1; "
        "capped by --capacity-factor (default 1: uniform)",
    )
    w.add_argument(
        "--pp-scatter-gather",
        action="store_true",
        help="pipeline messages split over the tp ranks across nodes, as Megatron-LM does",
    )
    w.add_argument(
        "--train-tokens",
        type=float,
        default=300e9,
        help="tokens for the total training time (default 3e11)",
    )


def _cluster_arguments(c: argparse._ArgumentGroup) -> None:
    c.add_argument("--gpus", type=int, help="GPUs in the job (default: one node)")
    c.add_argument("--gpus-per-node", type=int)
    c.add_argument("--gpu-memory-gb", type=float)
    c.add_argument("--intra-bw-gbs", type=float, help="NVLink GB/s per GPU per direction")
    c.add_argument("--inter-bw-gbs", type=float, help="InfiniBand GB/s per GPU per direction")
    c.add_argument("--intra-latency-us", type=float)
    c.add_argument("--inter-latency-us", type=float)
    c.add_argument("--peak-flops", type=float, help="peak FLOP/s per GPU")
    c.add_argument("--memory-bw-gbs", type=float, help="HBM GB/s per GPU (0: not counted)")
    c.add_argument("--utilisation", type=float, help="fraction of peak reached, 0 < u <= 1")


def _layout_arguments(lay: argparse._ArgumentGroup) -> None:
    for axis in ("dp", "tp", "pp", "cp", "ep"):
        lay.add_argument(f"--{axis}", type=int, help=f"{axis} degree")
    lay.add_argument(
        "--cp-method",
        default="ring",
        choices=CP_METHODS,
        help="context parallel attention: ring (keys and values travel, overlapped) or "
        "alltoall (Ulysses: heads travel) (default ring)",
    )
    lay.add_argument("--zero", type=int, help="ZeRO stage 0-3")
    lay.add_argument("--schedule", help=f"pipeline schedule: {', '.join(SCHEDULES)}")
    lay.add_argument("--chunks", type=int, default=1, help="model chunks per GPU (interleaved)")


def _output_arguments(out: argparse._ArgumentGroup) -> None:
    out.add_argument("--json", action="store_true", help="print the plan as JSON, last line")
    out.add_argument(
        "--chart", default="runs/plan.png", help="PNG chart path (default runs/plan.png)"
    )
    out.add_argument("--no-chart", action="store_true", help="do not write the chart")
    out.add_argument(
        "--validate",
        action="store_true",
        help="run small jobs here and compare predicted with measured",
    )
    out.add_argument(
        "--published",
        action="store_true",
        help="predict published runs (Megatron-LM, BLOOM) with each preset's one efficiency; "
        "exits 1 if any is off by more than 15%% or a layout ranking disagrees",
    )
    out.add_argument(
        "--validate-cases",
        default="",
        metavar="NAMES",
        help="with --validate, only these comma-separated cases: dp, tp, gpipe, 1f1b, "
        "interleaved, 3d, zero1, zero2-full, zero2-shard, zero3, ... (default: all)",
    )


def _positive(name: str, value: float | None) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"{name} {value}; must be > 0")


MOE_FLAGS = ("top_k", "expert_ffn", "shared_ffn", "capacity_factor")


def _moe_flags_need_experts(args: argparse.Namespace, model: ModelSpec) -> None:
    """A mixture-of-experts flag on a dense model would change nothing: refused."""
    given = [f for f in MOE_FLAGS if getattr(args, f) is not None]
    if args.moe_imbalance != 1.0:
        given.append("moe_imbalance")
    if given and not model.num_experts:
        flag = "--" + given[0].replace("_", "-")
        raise ValueError(f"{flag} needs a mixture of experts (--experts or a MoE preset)")


def specs_from_args(args: argparse.Namespace) -> tuple[ModelSpec, ClusterSpec, Workload]:
    model_name, cluster_name = None, None
    for name in args.preset:
        if name in MODEL_PRESETS and model_name is None:
            model_name = name
        elif name in CLUSTER_PRESETS and cluster_name is None:
            cluster_name = name
        else:
            valid = ", ".join([*MODEL_PRESETS, *CLUSTER_PRESETS])
            raise ValueError(f"preset {name!r} unknown or given twice; valid: {valid}")
    for flag in ("params", "gpu_memory_gb", "intra_bw_gbs", "inter_bw_gbs", "peak_flops"):
        _positive("--" + flag.replace("_", "-"), getattr(args, flag))
    shape = (args.layers, args.hidden, args.heads, args.vocab)
    if args.params is not None and model_name is None and all(v is None for v in shape):
        model = ModelSpec(
            "custom", n_params=int(args.params), seq_len=args.seq_len or DEFAULT_SEQ_LEN
        )
    else:
        base = model_preset(model_name or DEFAULT_MODEL)
        model = with_overrides(
            base,
            n_params=None if args.params is None else int(args.params),
            n_layer=args.layers,
            d_model=args.hidden,
            n_head=args.heads,
            vocab_size=args.vocab,
            seq_len=args.seq_len,
            num_experts=args.experts,
            top_k=args.top_k,
            expert_ffn=args.expert_ffn,
            shared_ffn=args.shared_ffn,
        )
        if args.capacity_factor is not None:
            _positive("--capacity-factor", args.capacity_factor)
            model = replace(model, capacity_factor=args.capacity_factor)
    _moe_flags_need_experts(args, model)
    us = 1e-6
    cluster = cluster_with(
        cluster_preset(cluster_name or DEFAULT_CLUSTER),
        gpus=args.gpus,
        gpus_per_node=args.gpus_per_node,
        gpu_memory_bytes=None if args.gpu_memory_gb is None else args.gpu_memory_gb * GB,
        intra_bw=None if args.intra_bw_gbs is None else args.intra_bw_gbs * GB,
        inter_bw=None if args.inter_bw_gbs is None else args.inter_bw_gbs * GB,
        intra_latency_s=None if args.intra_latency_us is None else args.intra_latency_us * us,
        inter_latency_s=None if args.inter_latency_us is None else args.inter_latency_us * us,
        peak_flops=args.peak_flops,
        utilisation=args.utilisation,
        memory_bw=None if args.memory_bw_gbs is None else args.memory_bw_gbs * GB,
    )
    g = args.global_batch
    if g is None and args.microbatches is None:
        g = 512
    workload = Workload(
        micro_batch=args.micro_batch,
        global_batch=g,
        microbatches=args.microbatches,
        precision=precision(args.precision),
        optimizer=args.optimizer,
        recompute=args.recompute,
        activation_bytes_override=None if args.activation_gb is None else args.activation_gb * GB,
        overlap=args.overlap,
        train_tokens=args.train_tokens,
        zero2_accumulate=args.zero2_accumulate,
        pp_scatter_gather=args.pp_scatter_gather,
        attention=args.attention,
        moe_imbalance=args.moe_imbalance,
    )
    return model, cluster, workload


def plan_from_args(args: argparse.Namespace) -> Plan:
    model, cluster, workload = specs_from_args(args)
    if args.schedule is not None and args.schedule not in SCHEDULES:
        raise ValueError(f"schedule {args.schedule!r}; valid: {', '.join(SCHEDULES)}")
    if args.chunks < 1:
        raise ValueError(f"chunks {args.chunks}; must be at least 1")
    if args.chunks > 1 and args.schedule not in (None, "interleaved"):
        raise ValueError(f"chunks {args.chunks} needs --schedule interleaved")
    if args.zero is not None and args.zero not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage {args.zero}; valid: 0, 1, 2, 3")
    for axis in ("dp", "tp", "pp", "cp", "ep"):
        _positive("--" + axis, getattr(args, axis))
    if args.ep not in (None, 1) and not model.num_experts:
        raise ValueError(f"--ep {args.ep} needs a mixture of experts (--experts or a MoE preset)")
    axes = ("dp", "tp", "pp", "cp", "ep", "zero")
    fixed = {a: getattr(args, a) for a in axes}
    layouts = candidate_layouts(
        cluster, args.schedule, args.chunks, fixed, model.num_experts, args.cp_method
    )
    if not layouts:
        given = ", ".join(f"{k}={v}" for k, v in fixed.items() if v is not None)
        raise ValueError(
            f"no layout with {given} on {cluster.gpus} GPUs: dp * cp * tp * pp must equal "
            "the GPUs, and ep divide dp * cp"
        )
    return plan(model, cluster, workload, layouts)


def run_plan(args: argparse.Namespace, validate: Callable[[], int] | None = None) -> int:
    """Print the table (and JSON last); write the chart.

    `--published` prints only the published-runs comparison and returns its status.
    validate: `plan --validate`'s measured runs, which the CLI hands in (the planner imports
    no benchmark); they run after the table, and their status is the command's.
    """
    if args.validate_cases and not args.validate:
        raise ValueError("--validate-cases needs --validate")
    if args.validate and validate is None:
        raise ValueError("--validate needs the measured runs: run it as `paratrain plan`")
    if args.published:
        from paratrain.plan.published_check import run_published

        return run_published()
    result = plan_from_args(args)
    print(table(result), flush=True)
    if not args.no_chart:
        print(f"chart: {chart(result, args.chart)}", flush=True)
    status = validate() if validate is not None else 0
    if args.json:
        print(json.dumps(result.as_dict()), flush=True)
    return status
