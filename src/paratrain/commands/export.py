"""`paratrain export RUN`: a run's checkpointed model, as one safetensors file of our names
or as a Hugging Face model directory; a LoRA run's merged (--merge-lora) or as a PEFT
adapter directory (trained/lora_export.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = "a run's checkpointed model, for other tools"


def add_arguments(export: argparse.ArgumentParser) -> None:
    export.add_argument("run_dir", help="the run directory (its checkpoints/ are read)")
    export.add_argument("--step", type=int, help="the checkpoint's step (default: the latest)")
    export.add_argument(
        "--format",
        choices=("safetensors", "hf", "peft"),
        default="safetensors",
        help="safetensors: one file of our names; hf: a Hugging Face model directory; peft: "
        "a LoRA run's adapter as PEFT loads it onto the transformers base (Llama)",
    )
    export.add_argument(
        "--merge-lora",
        action="store_true",
        help="a LoRA run's adapters folded into the base weights (safetensors, hf)",
    )
    export.add_argument(
        "--out",
        help="output (default: RUN_DIR/model.safetensors; required with --format hf or peft)",
    )


def run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():  # refused before torch loads
        raise ValueError(f"{args.run_dir!r} is not a directory; give a paratrain run directory")
    from paratrain import checkpoint
    from paratrain.checkpoint.whole_model import read_model
    from paratrain.trained.safetensors_file import export_safetensors, pick_checkpoint

    if args.format in ("hf", "peft") and not args.out:
        raise ValueError(f"--format {args.format} needs --out DIR, the new directory")
    if args.format == "peft":
        if args.merge_lora:
            raise ValueError("--merge-lora writes a whole model; --format peft the adapter alone")
        from paratrain.trained.lora_export import export_peft

        ckpt = pick_checkpoint(run_dir, args.step)
        meta = checkpoint.read_meta(ckpt.path)
        out = export_peft(run_dir, Path(args.out), read_model(ckpt.path), meta)
    elif args.format == "hf":
        from paratrain.trained.hf_directory import export_hf

        out = export_hf(run_dir, Path(args.out), args.step, args.merge_lora)
    else:
        out_file = Path(args.out) if args.out else None
        out = export_safetensors(run_dir, out_file, args.step, args.merge_lora)
    print(f"wrote {out}", flush=True)
    return 0
