"""`paratrain sample RUN --prompt P`: what a run's model writes after a prompt."""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = "what a run's model writes after a prompt"


def add_arguments(smp: argparse.ArgumentParser) -> None:
    smp.add_argument("run_dir", help="the run directory (its latest checkpoint is read)")
    smp.add_argument("--prompt", required=True, help="the text to continue")
    smp.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate")
    smp.add_argument("--temperature", type=float, default=0.8, help="0: greedy (argmax)")
    smp.add_argument("--top-k", type=int, default=0, help="draw from the k likeliest; 0: all")
    smp.add_argument("--seed", type=int, default=0, help="seed of the draws")
    smp.add_argument(
        "--chat",
        action="store_true",
        help="the prompt is a user's message: rendered with the chat template the run's "
        "data was prepared with, and only the answer printed, up to its end of turn",
    )


def _run_dir(text: str) -> Path:
    path = Path(text)
    if not path.is_dir():
        raise ValueError(f"{text!r} is not a directory; give a paratrain run directory")
    return path


def run(args: argparse.Namespace) -> int:
    run_dir = _run_dir(args.run_dir)  # refused before torch loads
    from paratrain.trained.run_model import sample

    text = sample(
        run_dir,
        args.prompt,
        args.max_new_tokens,
        args.temperature,
        args.top_k,
        args.seed,
        args.chat,
    )
    print(text, flush=True)
    return 0
