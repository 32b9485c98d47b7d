"""The work of `paratrain plan`: flags to specs, specs to a plan (plan/), the plan to a
table, JSON or a chart.

Flags override presets: `--preset 7b --preset a100-80gb-nvlink300-ib25 --gpus 64`.
Every bad value raises ValueError naming it and what is valid; cli.main prints one line.
`--validate`'s measured runs are the benchmarks' (bench/planner/); the CLI passes them in,
so that the planner stays pure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable
from dataclasses import replace

from paratrain.commands.plan_flags import DEFAULT_MODEL, DEFAULT_SEQ_LEN
from paratrain.plan.cluster import (
    CLUSTER_PRESETS,
    DEFAULT_CLUSTER,
    GB,
    ClusterSpec,
    cluster_preset,
    cluster_with,
)
from paratrain.plan.layout import (
    SCHEDULES,
    LoraSpec,
    Workload,
    precision,
)
from paratrain.plan.model import MODEL_PRESETS, ModelSpec, model_preset, with_overrides
from paratrain.plan.muon import block_matrices
from paratrain.plan.recommend import Plan, candidate_layouts, plan
from paratrain.plan.report import table
from paratrain.plan.summary import fastest_fitting

__all__ = ["plan_from_args", "run_plan", "specs_from_args"]  # the flags: plan_flags.py


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
    """The planner's three inputs from the flags: model, cluster, workload."""
    model_name, cluster_name = _presets(args.preset)
    for flag in ("params", "gpu_memory_gb", "intra_bw_gbs", "inter_bw_gbs", "peak_flops"):
        _positive("--" + flag.replace("_", "-"), getattr(args, flag))
    model = _model(args, model_name)
    _moe_flags_need_experts(args, model)
    workload = replace(_workload(args), lora=_lora(args.lora_rank, model))
    _compression(workload, model)
    _diloco(args, workload, model)
    return model, _cluster(args, cluster_name), workload


def _diloco(args: argparse.Namespace, workload: Workload, model: ModelSpec) -> None:
    """--dp-mode diloco: what the estimates price (plan/diloco_cost.py)."""
    if args.dp_mode != "diloco":
        for flag, given, default in [("--sync-every", args.sync_every, 100),
                                     ("--outer-dtype", args.outer_dtype, "float32")]:  # fmt: skip
            if given != default:
                raise ValueError(f"{flag} {given} has no effect here: it needs --dp-mode diloco")
        return
    if args.sync_every < 1:
        raise ValueError(f"--sync-every {args.sync_every}: must be at least 1")
    if args.replicas in (None, 1):
        raise ValueError("--dp-mode diloco trains replica groups apart: give --replicas 2 or more")
    if workload.compress != "none" or model.num_experts or workload.lora is not None:
        raise ValueError(
            "--dp-mode diloco is priced for a dense model without --compress or --lora-rank"
        )


def _compression(workload: Workload, model: ModelSpec) -> None:
    """--compress: what the estimates price (plan/compress_cost.py)."""
    method, rank = workload.compress, workload.compress_rank
    if rank < 1:
        raise ValueError(f"--compress-rank {rank}: must be at least 1")
    if method != "none" and workload.lora is not None:
        raise ValueError(f"--compress {method} with --lora-rank: not priced; use one of them")
    if method == "powersgd" and (not model.has_shape or model.num_experts):
        raise ValueError(
            "--compress powersgd is priced from the matrices' shapes: a dense model given by "
            "its shape (a preset, or --layers --hidden --heads --vocab --seq-len)"
        )


def _lora(rank: int, model: ModelSpec) -> LoraSpec | None:
    """--lora-rank: adapters on every matrix of a block (the model plans' lora_targets)."""
    if rank < 0 or (rank and (not model.has_shape or model.num_experts)):
        raise ValueError(
            f"--lora-rank {rank}: must be 0 or more, on a dense model given by its shape "
            "(a preset, or --layers --hidden --heads --vocab --seq-len)"
        )
    return LoraSpec(rank, tuple(range(len(block_matrices(model.shape))))) if rank else None


def _presets(names: list[str]) -> tuple[str | None, str | None]:
    """(model preset, cluster preset) among the positional names, at most one of each."""
    model_name, cluster_name = None, None
    for name in names:
        if name in MODEL_PRESETS and model_name is None:
            model_name = name
        elif name in CLUSTER_PRESETS and cluster_name is None:
            cluster_name = name
        else:
            valid = ", ".join([*MODEL_PRESETS, *CLUSTER_PRESETS])
            raise ValueError(f"preset {name!r} unknown or given twice; valid: {valid}")
    return model_name, cluster_name


def _model(args: argparse.Namespace, model_name: str | None) -> ModelSpec:
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
    return model


def _cluster(args: argparse.Namespace, cluster_name: str | None) -> ClusterSpec:
    us = 1e-6
    return cluster_with(
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


def _workload(args: argparse.Namespace) -> Workload:
    g = args.global_batch
    if g is None and args.microbatches is None:
        g = 512
    return Workload(
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
        compress=args.compress,
        compress_rank=args.compress_rank,
        sync_every=args.sync_every if args.dp_mode == "diloco" else 0,
        outer_dtype=args.outer_dtype,
    )


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
    for axis in ("dp", "tp", "pp", "cp", "ep", "replicas"):
        _positive("--" + axis, getattr(args, axis))
    if args.replicas not in (None, 1) and args.zero == 0:
        raise ValueError(f"--replicas {args.replicas} needs ZeRO 1, 2 or 3 (HSDP), not --zero 0")
    if args.replicas not in (None, 1) and args.ep not in (None, 1):
        raise ValueError(f"--replicas {args.replicas} with --ep {args.ep} is not supported yet")
    if args.ep not in (None, 1) and not model.num_experts:
        raise ValueError(f"--ep {args.ep} needs a mixture of experts (--experts or a MoE preset)")
    axes = ("dp", "tp", "pp", "cp", "ep", "zero", "replicas")
    fixed = {a: getattr(args, a) for a in axes}
    layouts = candidate_layouts(
        cluster, args.schedule, args.chunks, fixed, model.num_experts, args.cp_method
    )
    if not layouts:
        given = ", ".join(f"{k}={v}" for k, v in fixed.items() if v is not None)
        raise ValueError(
            f"no layout with {given} on {cluster.gpus} GPUs: dp * cp * tp * pp must equal "
            "the GPUs, ep divide dp * cp, and replicas divide dp"
        )
    return plan(model, cluster, workload, layouts)


def run_plan(args: argparse.Namespace, validate: Callable[[], int] | None = None) -> int:
    """Print the table, or with --json only the plan's JSON; write a chart if asked.

    `--published` prints only the published-runs comparison and returns its status.
    validate: `plan --validate`'s measured runs, which the CLI hands in (the planner imports
    no benchmark); they run after the table (on stderr under --json, so that stdout stays
    one JSON document), and their status is the command's.
    """
    if args.validate_cases and not args.validate:
        raise ValueError("--validate-cases needs --validate")
    if args.validate and validate is None:
        raise ValueError("--validate needs the measured runs: run it as `paratrain plan`")
    if args.published:
        from paratrain.plan.published_check import run_published

        return run_published()
    result = plan_from_args(args)
    if args.json:
        quick = fastest_fitting(result)
        data = result.as_dict() | {"fastest": quick.as_dict() if quick else None}
        print(json.dumps(data), flush=True)
    else:
        print(table(result, args.sort, args.all), flush=True)
    if args.chart:
        from paratrain.plan.chart import chart

        path = chart(result, args.chart, args.sort)
        print(f"chart: {path}", file=sys.stderr if args.json else sys.stdout, flush=True)
    if validate is None:
        return 0
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        return validate()
