"""`paratrain export RUN`: a run's checkpointed model, as one safetensors file of our names
or as a Hugging Face model directory."""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = "a run's checkpointed model, for other tools"


def add_arguments(export: argparse.ArgumentParser) -> None:
    export.add_argument("run_dir", help="the run directory (its checkpoints/ are read)")
    export.add_argument("--step", type=int, help="the checkpoint's step (default: the latest)")
    export.add_argument(
        "--format",
        choices=("safetensors", "hf"),
        default="safetensors",
        help="safetensors: one file of our names; hf: a Hugging Face model directory",
    )
    export.add_argument(
        "--out", help="output (default: RUN_DIR/model.safetensors; required with --format hf)"
    )


def run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():  # refused before torch loads
        raise ValueError(f"{args.run_dir!r} is not a directory; give a paratrain run directory")
    from paratrain.trained.safetensors_file import export_safetensors

    if args.format == "hf":
        from paratrain.trained.hf_directory import export_hf

        if not args.out:
            raise ValueError("--format hf needs --out DIR, the new Hugging Face directory")
        out = export_hf(run_dir, Path(args.out), args.step)
    else:
        out = export_safetensors(run_dir, Path(args.out) if args.out else None, args.step)
    print(f"wrote {out}", flush=True)
    return 0
