"""`paratrain import-hf DIR --out RUN`: a Hugging Face model directory as a new run."""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = "a Hugging Face model directory as a new run"


def add_arguments(imp: argparse.ArgumentParser) -> None:
    imp.add_argument("hf_dir", help="a save_pretrained directory: config.json + safetensors")
    imp.add_argument("--out", required=True, help="the new run directory")


def run(args: argparse.Namespace) -> int:
    hf_dir = Path(args.hf_dir)
    if not hf_dir.is_dir():  # refused before torch loads
        raise ValueError(f"{args.hf_dir!r} is not a directory; give a save_pretrained directory")
    from paratrain.trained.hf_directory import import_hf

    run_dir = import_hf(hf_dir, args.out)
    print(f"wrote {run_dir} (train from it: paratrain train --init-from {run_dir})", flush=True)
    return 0
