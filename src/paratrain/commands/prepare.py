"""`paratrain prepare`: text tokenized into memory-mapped token shards (data/prepare.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from paratrain.data.chat_template import CHOICES
from paratrain.data.supervised import FORMATS

HELP = "tokenize text into memory-mapped token shards"


def add_arguments(prep: argparse.ArgumentParser) -> None:
    prep.add_argument("--data", required=True, help="text file, JSON-lines or a folder")
    prep.add_argument("--tokenizer", required=True, help="a tokenizer.json with <|endoftext|>")
    prep.add_argument("--out", required=True, help="the data directory (resumed if interrupted)")
    prep.add_argument("--val-fraction", type=float, default=0.05, help="documents held out")
    prep.add_argument("--workers", type=int, default=0, help="processes; 0: one per core")
    prep.add_argument(
        "--format",
        default="text",
        choices=FORMATS,
        help="text (every token a target), chat (JSON lines of 'messages'; only the "
        "assistant's turns are targets) or prompt-completion (only the completion is)",
    )
    prep.add_argument(
        "--chat-template",
        default="auto",
        choices=CHOICES,
        help="how --format chat renders a conversation: tokenizer (the chat_template of the "
        "tokenizer_config.json beside --tokenizer), default (paratrain's, documented in "
        "docs/models.md), auto (the tokenizer's where it has one)",
    )


def run(args: argparse.Namespace) -> int:
    from paratrain.data.prepare import prepare

    if args.workers < 0:
        raise ValueError(f"--workers {args.workers}: 0 (one per core) or more")
    data, tokenizer, out = Path(args.data), Path(args.tokenizer), Path(args.out)
    # the bar's carriage-return frames only where a terminal draws them, not into a log
    progress = sys.stderr.isatty()
    meta = prepare(
        data,
        tokenizer,
        out,
        args.val_fraction,
        args.workers,
        progress,
        fmt=args.format,
        chat_template=args.chat_template,
    )
    n, d = meta["tokens"], meta["documents"]
    kind = "documents" if args.format == "text" else f"{args.format} examples"
    print(
        f"wrote {args.out}: {n['train']:,} train tokens ({d['train']:,} {kind}), "
        f"{n['val']:,} held out ({d['val']:,}), {meta['dtype']}",
        flush=True,
    )
    return 0
