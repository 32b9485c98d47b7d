"""The commands around training that read or write runs and data, not train them:
`export`, `import-hf`, `sample`, `eval`, `tokenizer train`, `prepare`. cli.py adds their
parsers and hands them their arguments (eval's go to paratrain/eval_command.py, which
launches workers as train does); each loads its module only when it runs."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

RUN_TOOLS = ("export", "import-hf", "sample", "tokenizer", "prepare")  # eval: in cli.py


def add_run_tool_parsers(sub: Any) -> None:
    """The subcommands' parsers, on the CLI's subparsers."""
    export = sub.add_parser("export", help="a run's checkpointed model, for other tools")
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
    tok = sub.add_parser("tokenizer", help="train a byte-level BPE tokenizer")
    tok_sub = tok.add_subparsers(dest="tokenizer_command", required=True)
    tok_train = tok_sub.add_parser("train", help="a byte-level BPE on text files")
    tok_train.add_argument("--data", required=True, help="text file, JSON-lines or a folder")
    tok_train.add_argument("--vocab-size", type=int, required=True, help="ids, EOT included")
    tok_train.add_argument("--out", required=True, help="the tokenizer.json to write")
    prep = sub.add_parser("prepare", help="tokenize text into memory-mapped token shards")
    prep.add_argument("--data", required=True, help="text file, JSON-lines or a folder")
    prep.add_argument("--tokenizer", required=True, help="a tokenizer.json with <|endoftext|>")
    prep.add_argument("--out", required=True, help="the data directory (resumed if interrupted)")
    prep.add_argument("--val-fraction", type=float, default=0.05, help="documents held out")
    prep.add_argument("--workers", type=int, default=0, help="processes; 0: one per core")
    smp = sub.add_parser("sample", help="what a run's model writes after a prompt")
    smp.add_argument("run_dir", help="the run directory (its latest checkpoint is read)")
    smp.add_argument("--prompt", required=True, help="the text to continue")
    smp.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate")
    smp.add_argument("--temperature", type=float, default=0.8, help="0: greedy (argmax)")
    smp.add_argument("--top-k", type=int, default=0, help="draw from the k likeliest; 0: all")
    smp.add_argument("--seed", type=int, default=0, help="seed of the draws")
    ev = sub.add_parser("eval", help="a run's loss and perplexity on a data file")
    ev.add_argument("run_dir", help="the run directory (its latest checkpoint is read)")
    ev.add_argument("--data", required=True, help="text file, folder of text, or .bin of ids")
    ev.add_argument("--seq-len", type=int, help="window length (default: the run's seq_len)")
    ev.add_argument("--json", action="store_true", help="print a JSON object as last line")
    ev.add_argument("--nproc", type=int, default=1, help="worker processes (a mesh if > 1)")
    ev.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    ev.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree")
    ev.add_argument("--zero", type=int, default=0, help="ZeRO stage (3: sharded parameters)")
    ev.add_argument("--device", default="auto", help="cpu, cuda or auto")
    imp = sub.add_parser("import-hf", help="a Hugging Face model directory as a new run")
    imp.add_argument("hf_dir", help="a save_pretrained directory: config.json + safetensors")
    imp.add_argument("--out", required=True, help="the new run directory")


def run_tool(args: argparse.Namespace) -> int:
    commands = {
        "export": cmd_export,
        "import-hf": cmd_import_hf,
        "sample": cmd_sample,
        "tokenizer": cmd_tokenizer,
        "prepare": cmd_prepare,
    }
    return commands[args.command](args)


def cmd_export(args: argparse.Namespace) -> int:
    from paratrain.train.export import export_safetensors

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"{args.run_dir!r} is not a directory; give a paratrain run directory")
    if args.format == "hf":
        from paratrain.train.hf_io import export_hf

        if not args.out:
            raise ValueError("--format hf needs --out DIR, the new Hugging Face directory")
        out = export_hf(run_dir, Path(args.out), args.step)
    else:
        out = export_safetensors(run_dir, Path(args.out) if args.out else None, args.step)
    print(f"wrote {out}", flush=True)
    return 0


def _run_dir(text: str) -> Path:
    path = Path(text)
    if not path.is_dir():
        raise ValueError(f"{text!r} is not a directory; give a paratrain run directory")
    return path


def cmd_sample(args: argparse.Namespace) -> int:
    from paratrain.train.inspect_run import sample

    text = sample(
        _run_dir(args.run_dir),
        args.prompt,
        args.max_new_tokens,
        args.temperature,
        args.top_k,
        args.seed,
    )
    print(text, flush=True)
    return 0


def cmd_tokenizer(args: argparse.Namespace) -> int:
    from paratrain.data.tokenizer import train_tokenizer

    vocab = train_tokenizer(Path(args.data), args.vocab_size, Path(args.out))
    print(f"wrote {args.out}: byte-level BPE of {vocab:,} ids", flush=True)
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from paratrain.data.prepare import prepare

    if args.workers < 0:
        raise ValueError(f"--workers {args.workers}: 0 (one per core) or more")
    meta = prepare(
        Path(args.data), Path(args.tokenizer), Path(args.out), args.val_fraction, args.workers
    )
    n, d = meta["tokens"], meta["documents"]
    print(
        f"wrote {args.out}: {n['train']:,} train tokens ({d['train']:,} documents), "
        f"{n['val']:,} held out ({d['val']:,}), {meta['dtype']}",
        flush=True,
    )
    return 0


def cmd_import_hf(args: argparse.Namespace) -> int:
    from paratrain.train.hf_io import import_hf

    hf_dir = Path(args.hf_dir)
    if not hf_dir.is_dir():
        raise ValueError(f"{args.hf_dir!r} is not a directory; give a save_pretrained directory")
    run_dir = import_hf(hf_dir, args.out)
    print(f"wrote {run_dir} (train from it: paratrain train --init-from {run_dir})", flush=True)
    return 0
