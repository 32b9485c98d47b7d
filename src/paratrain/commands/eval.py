"""`paratrain eval RUN [--data D]`: a run's loss and perplexity on a data file (by default its
own held-out split), in this
process or on a mesh of workers (the work: commands/eval_launch.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = "a run's loss and perplexity on its held-out split or a data file"


def add_arguments(ev: argparse.ArgumentParser) -> None:
    ev.add_argument("run_dir", help="the run directory (its latest checkpoint is read)")
    ev.add_argument(
        "--data",
        help="text file, folder of text, or .bin of ids (default: the run's own held-out split)",
    )
    ev.add_argument("--seq-len", type=int, help="window length (default: the run's seq_len)")
    ev.add_argument("--json", action="store_true", help="print a JSON object as last line")
    ev.add_argument("--nproc", type=int, default=1, help="worker processes (a mesh if > 1)")
    ev.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    ev.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree")
    ev.add_argument("--zero", type=int, default=0, help="ZeRO stage (3: sharded parameters)")
    ev.add_argument("--device", default="auto", help="cpu, cuda or auto")


def run(args: argparse.Namespace) -> int:
    if not Path(args.run_dir).is_dir():  # refused before torch loads
        raise ValueError(f"{args.run_dir!r} is not a directory; give a paratrain run directory")
    data = Path(args.data) if args.data is not None else None
    if data is not None and data.is_file() and data.suffix != ".bin":  # binary as text
        from paratrain.data.files import check_is_text

        check_is_text(data)
    from paratrain.commands.eval_launch import evaluate_run  # launches workers, as train does

    return evaluate_run(args)
