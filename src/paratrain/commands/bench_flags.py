"""The flags of `paratrain bench NAME`, one sub-command per benchmark (commands/bench.py
runs them). A parser imports nothing heavy: no torch, no bench/ package."""

from __future__ import annotations

import argparse
from typing import Any

JSON_HELP = "print a JSON result as last line"


def add_arguments(bench: argparse.ArgumentParser) -> None:
    # The CLI's parser class (one-line errors) for the sub-commands too.
    benches = bench.add_subparsers(dest="name", required=True, parser_class=type(bench))
    _step_benches(benches)
    _layout_benches(benches)
    for parser in benches.choices.values():
        parser.add_argument("--json", action="store_true", help=JSON_HELP)


Subparsers = Any  # argparse's _SubParsersAction, private


def count(text: str) -> int:
    """A bench's count (steps, rounds, ranks, sizes): a whole number, at least 1, refused
    by the parser otherwise, before anything runs."""
    value = int(text)  # not a number: argparse says "invalid count value"
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: must be at least 1")
    return value


def _step_benches(benches: Subparsers) -> None:
    """The benches of one training step or one mechanism, in `bench --help`'s order."""
    overhead = benches.add_parser("overhead", help="our training step against a plain loop")
    overhead.add_argument("--steps", type=count, default=20, help="timed steps per round")
    overhead.add_argument("--rounds", type=count, default=7, help="alternating rounds of each loop")
    overhead.add_argument(
        "--peer",
        choices=("plain", "transformers"),
        default="plain",
        help="the plain loop's model: ours, or transformers' GPT2LMHeadModel with our weights",
    )
    overhead.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="then profile N more steps of each loop and list the ops that differ most",
    )
    _compile(overhead)
    _comm_flags(benches.add_parser("comm", help="native, ring, tree collectives"))
    dp = benches.add_parser("dp", help="DataParallel against torch DDP; overlap; sync vs async")
    _pairs(dp, 4)
    dp.add_argument("--bucket-mb", type=float, default=25.0, help="bucket size of both wrappers")
    dp.add_argument("--async-steps", type=count, default=40, help="steps of the straggler runs")
    _compile(dp)
    tp = benches.add_parser("tp", help="tensor parallel against torch DTensor")
    _pairs(tp, 4)
    tp.add_argument(
        "--sequence-parallel",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="both sides sequence parallel (ours; DTensor SequenceParallel)",
    )
    _compile(tp)
    overlap = benches.add_parser("overlap", help="communication hidden behind compute, by time")
    _pairs(overlap, 4)
    overlap.add_argument(
        "--mechanisms", default="dp-buckets,zero2,fsdp-prefetch", help="comma-separated"
    )
    overlap.add_argument("--algos", default="native,ring", help="comma-separated")


def _layout_benches(benches: Subparsers) -> None:
    """The benches of layouts, schedules, ZeRO stages, cp and ep, in `bench --help`'s order."""
    layouts = benches.add_parser("layouts", help="every 8-rank layout: time, bytes, memory")
    layouts.add_argument("--steps", type=count, default=4, help="steps per layout (first: warm-up)")
    pp = benches.add_parser("pp", help="pipeline schedules against torch pipelining")
    _pairs(pp, 2)
    pp.add_argument(
        "--schedules",
        default="",
        help="ours, comma-separated (default gpipe,1f1b,interleaved,zb-h1; without zb-h1 "
        "under --compile)",
    )
    _compile(pp)
    pp.add_argument("--microbatches", type=count, default=8, help="micro-batches K per step")
    pp.add_argument("--out", default="runs/bench-pp", help="folder for Gantt PNGs ('' none)")
    zero = benches.add_parser("zero", help="ZeRO 0-3 against DDP, +ZeRO, FSDP2")
    _pairs(zero, 4)
    zero.add_argument(
        "--stages",
        default="0,1,2,3,hsdp",
        help="ZeRO stages, comma-separated; hsdp: ZeRO-3 in 2 replica groups against FSDP2's"
        " HSDP on a 2-D mesh",
    )
    zero.add_argument("--dp", type=count, default=2, help="ranks (time only at 2 on 2 cores)")
    zero.add_argument("--out", default="runs/bench-zero.png", help="PNG plot ('' for none)")
    _compile(zero)
    cp = benches.add_parser("cp", help="context-parallel attention against one process")
    _pairs(cp, 2)
    cp.add_argument("--methods", default="ring,alltoall", help="ours, comma-separated")
    cp.add_argument("--seq-len", type=count, default=2048, help="tokens of the whole sequence")
    cp.add_argument("--batch", type=count, default=1, help="sequences")
    cp.add_argument("--heads", type=count, default=8, help="query heads")
    cp.add_argument("--kv-heads", type=count, default=4, help="key/value heads")
    cp.add_argument("--head-dim", type=count, default=64, help="dimension of a head")
    moe = benches.add_parser("moe", help="expert dispatch and combine against tokens per rank")
    _pairs(moe, 2)
    moe.add_argument("--tokens", default="256,1024,4096", help="tokens per rank, a sweep")
    moe.add_argument("--d-model", type=count, default=512, help="width of a token's row")
    moe.add_argument("--experts", type=count, default=8, help="experts, split over 2 ranks")
    moe.add_argument("--top-k", type=count, default=2, help="experts per token")
    model = benches.add_parser("model", help="our GPT and Llama against transformers' models")
    _pairs(model, 4)
    model.add_argument(
        "--models", default="gpt-tiny,llama-tiny", help="presets, comma-separated (gpt2-124m...)"
    )
    model.add_argument("--seq-len", type=count, default=128, help="tokens per sequence")
    model.add_argument("--batch", type=count, default=8, help="sequences per step")
    model.add_argument("--what", default="fwd-bwd,step", help="forward+backward, whole step")
    _optimizer_benches(benches)


def _optimizer_benches(benches: Subparsers) -> None:
    """DiLoCo, Muon and LoRA: ways of training against the usual one."""
    diloco = benches.add_parser(
        "diloco", help="DiLoCo's step time against data parallelism's as the link slows"
    )
    diloco.add_argument(
        "--pairs", type=int, default=3, help="alternating runs of each way per link (at least 2)"
    )
    diloco.set_defaults(min_pairs=2)
    diloco.add_argument("--steps", type=count, default=40, help="steps of each run")
    diloco.add_argument("--sync-every", type=count, default=10, help="DiLoCo's H")
    diloco.add_argument(
        "--link-latency",
        type=float,
        help="one link only: seconds per message step between the ranks (default: a sweep)",
    )
    diloco.add_argument(
        "--link-bandwidth",
        type=float,
        help="one link only: bytes per second between the ranks, 0 for no limit (1.25e8 is "
        "1 Gbit/s; default: a sweep)",
    )
    slow = benches.add_parser(
        "slow-links", help="validation loss and bytes across groups: DP, compression, DiLoCo"
    )
    slow.add_argument("--groups", type=count, default=2, help="replica groups (one rank each)")
    slow.add_argument("--steps", type=count, default=300, help="steps of each run")
    slow.add_argument("--short", type=count, default=20, help="DiLoCo's shorter H")
    slow.add_argument("--long", type=count, default=100, help="DiLoCo's longer H")
    slow.add_argument("--compress-rank", type=count, default=4, help="PowerSGD's rank")
    muon = benches.add_parser("muon", help="our Muon against torch.optim.Muon; Muon vs AdamW")
    _pairs(muon, 4)
    muon.add_argument("--steps", type=count, default=300, help="steps of the training runs")
    muon.add_argument("--every", type=count, default=50, help="held-out loss every so many steps")
    _lora_bench(benches)


def _lora_bench(benches: Subparsers) -> None:
    lora = benches.add_parser("lora", help="LoRA against full fine-tuning: step, state, curve")
    _pairs(lora, 4)
    lora.add_argument("--rank", type=count, default=8, help="the adapters' rank (alpha 2x)")
    lora.add_argument("--steps", type=count, default=100, help="fine-tuning steps of each run")
    lora.add_argument("--base-steps", type=count, default=200, help="pre-training steps")
    lora.add_argument("--every", type=count, default=20, help="held-out loss every so many steps")
    lora.add_argument(
        "--lora-lr-scale", type=float, default=1.0, help="LoRA's learning rate over the full's"
    )


def _compile(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--compile",
        action="store_true",
        help="compile each block of both sides with torch.compile, as `train --compile`",
    )


def _pairs(parser: argparse.ArgumentParser, minimum: int) -> None:
    parser.add_argument(
        "--pairs", type=int, default=20, help=f"alternating step pairs (at least {minimum})"
    )
    parser.set_defaults(min_pairs=minimum)


# bench/comm/sweep.py's OPS and DEFAULT_SIZES_FLAG, written out: sweep imports the comm
# package, hence torch, which a parser must not (tests/test_cli_main.py checks they agree).
COMM_OPS_FLAG = "all_reduce,reduce_scatter,all_gather,broadcast,reduce,all_to_all"
COMM_SIZES_FLAG = "1KB,4KB,16KB,64KB,256KB,1MB,4MB,16MB,64MB"


def _comm_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ops", default=COMM_OPS_FLAG, help="collectives, comma-separated")
    parser.add_argument(
        "--algos", default="native,ring,tree,pairwise", help="algorithms to compare"
    )
    parser.add_argument("--world-sizes", default="2,4,8", help="ranks per run, e.g. 2,4,8")
    parser.add_argument("--sizes", default=COMM_SIZES_FLAG, help="message sizes, e.g. 1KB,1MB,64MB")
    parser.add_argument(
        "--repeats",
        type=count,
        default=10,
        help="timed samples (a third, at least 3, above 4 MB or with more ranks than cores)",
    )
    parser.add_argument("--out", default="runs/bench-comm.png", help="PNG plot ('' for none)")
