"""`paratrain tokenizer train`: a byte-level BPE tokenizer trained on text files."""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = "train a byte-level BPE tokenizer"


def add_arguments(tok: argparse.ArgumentParser) -> None:
    tok_sub = tok.add_subparsers(dest="tokenizer_command", required=True)
    tok_train = tok_sub.add_parser("train", help="a byte-level BPE on text files")
    tok_train.add_argument("--data", required=True, help="text file, JSON-lines or a folder")
    tok_train.add_argument("--vocab-size", type=int, required=True, help="ids, EOT included")
    tok_train.add_argument("--out", required=True, help="the tokenizer.json to write")


def run(args: argparse.Namespace) -> int:
    from paratrain.data.tokenizer import train_tokenizer

    vocab = train_tokenizer(Path(args.data), args.vocab_size, Path(args.out))
    print(f"wrote {args.out}: byte-level BPE of {vocab:,} ids", flush=True)
    return 0
