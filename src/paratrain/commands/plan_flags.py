"""`paratrain plan`'s flags: the model, training, cluster, layout and output groups.

Parsed into specs by command.py; every value is checked there (ValueError naming it) or
by argparse's choices.
"""

from __future__ import annotations

import argparse

from paratrain.config.choices import COMPRESS_METHODS, OUTER_DTYPES
from paratrain.plan.cluster import CLUSTER_DESCRIPTIONS, DEFAULT_CLUSTER
from paratrain.plan.layout import ATTENTION, CP_METHODS, RECOMPUTE, SCHEDULES, ZERO2_ACCUMULATE
from paratrain.plan.model import MODEL_PRESETS
from paratrain.plan.summary import DEFAULT_ROWS, SORTS

DEFAULT_MODEL = "7b"
DEFAULT_SEQ_LEN = 2048  # for a model given by its parameter count alone


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    clusters = "; ".join(f"{k}: {v}" for k, v in CLUSTER_DESCRIPTIONS.items())
    p.add_argument(
        "--preset",
        action="append",
        default=[],
        metavar="NAME",
        help=f"a model and a cluster preset, repeatable (default: {DEFAULT_MODEL}, "
        f"{DEFAULT_CLUSTER}). Models: {', '.join(MODEL_PRESETS)}. Clusters, "
        f"{clusters.replace('%', '%%')}",
    )
    _model_arguments(p.add_argument_group("model (overrides the preset)"))
    training = p.add_argument_group("training")
    _training_arguments(training)
    _lora_argument(training)
    _compress_arguments(training)
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


def _lora_argument(w: argparse._ArgumentGroup) -> None:
    w.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="LoRA fine-tuning: the base frozen (compute-dtype weights only) and rank-r "
        "adapters on every block's attention and MLP matrices (plan/lora.py); 0: every "
        "parameter trains (default 0)",
    )


def _compress_arguments(w: argparse._ArgumentGroup) -> None:
    w.add_argument(
        "--compress",
        default="none",
        choices=COMPRESS_METHODS,
        help="error-feedback compression of the data-parallel gradients (docs/compression.md):"
        " their bytes and error buffers in every layout (default none)",
    )
    w.add_argument("--compress-rank", type=int, default=1, help="PowerSGD's rank (default 1)")
    w.add_argument(
        "--dp-mode",
        default="sync",
        choices=("sync", "diloco"),
        help="diloco: the --replicas groups train apart, an outer step every --sync-every "
        "steps (docs/diloco.md; default sync)",
    )
    w.add_argument("--sync-every", type=int, default=100, help="DiLoCo's H (default 100)")
    w.add_argument(
        "--outer-dtype",
        default="float32",
        choices=OUTER_DTYPES,
        help="DiLoCo's pseudo-gradient on the wire (default float32)",
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
    lay.add_argument(
        "--replicas",
        type=int,
        help="HSDP: ZeRO within this many replica groups of the dp ranks, the shards "
        "all-reduced across them (layouts with ZeRO 1-3 and dp divisible by it; default 1)",
    )
    lay.add_argument("--schedule", help=f"pipeline schedule: {', '.join(SCHEDULES)}")
    lay.add_argument("--chunks", type=int, default=1, help="model chunks per GPU (interleaved)")


def _output_arguments(out: argparse._ArgumentGroup) -> None:
    out.add_argument(
        "--json", action="store_true", help="print only the plan as JSON (one line) on stdout"
    )
    out.add_argument(
        "--sort",
        default="time",
        choices=SORTS,
        help="order of the table: step time, memory per GPU or MFU (default time)",
    )
    out.add_argument(
        "--all",
        action="store_true",
        help=f"list every layout, and the rejected ones with why (default: the best "
        f"{DEFAULT_ROWS})",
    )
    out.add_argument(
        "--chart",
        metavar="FILE",
        help="write a PNG chart of the listed layouts, the recommended and the fastest among them",
    )
    out.add_argument("--no-chart", action="store_true", help=argparse.SUPPRESS)  # the old default
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
