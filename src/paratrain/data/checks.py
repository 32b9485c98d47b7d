"""The data, checked before any worker starts: every problem a worker would meet on reading
it is refused here, in one line naming the path and what would be valid.

- a path that is missing, unreadable or empty, or a folder with no text files;
- a binary file given as text (NUL bytes, or much invalid UTF-8: data/files.py);
- too little text (or ids) for one training sequence, or for one validation batch;
- a .bin whose size is not a whole number of uint16 ids, or whose ids exceed the model's
  vocabulary (read through a memory map in chunks: time proportional to the file, memory
  constant, a progress bar when it takes more than a second);
- prepared shards that are not whole, or of another tokenizer than --tokenizer's.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from paratrain.data.files import check_is_text, data_tokenizer, is_val_file
from paratrain.data.prepared import is_prepared, read_data_meta
from paratrain.data.supervised import run_row_layout
from paratrain.data.tokenizer import TEXT_SUFFIXES, load_tokenizer

CHUNK = 1 << 24  # ids per read of a .bin's maximum: 32 MiB of uint16


def tokenizer_vocab(cfg: Any) -> int | None:
    """The vocabulary of the data's tokenizer (--tokenizer's or a prepared directory's);
    None for bytes and .bin ids. Cheap: what the CLI pads the model's vocabulary to."""
    if is_prepared(cfg.data.path):
        return int(read_data_meta(Path(cfg.data.path))["vocab_size"])
    source = data_tokenizer(cfg)
    return None if source is None else int(load_tokenizer(source).get_vocab_size())


def check_data(cfg: Any) -> str:
    """Refuse what a worker would fail on; return what was checked, in words."""
    path, tokenizer = cfg.data.path, cfg.data.tokenizer
    packing = cfg.data.packing
    if packing == "documents" and cfg.parallel.cp > 1:
        raise ValueError(
            f"--packing documents with --cp {cfg.parallel.cp}: context-parallel attention "
            "takes no document mask; use --packing none (one document a row) or --cp 1"
        )
    if packing in ("none", "documents") and not is_prepared(path):
        raise ValueError(
            f"--packing {packing} cuts rows of whole documents, which only a data set made "
            f"by paratrain prepare records; --data {path or 'the default'!r} is not one"
        )
    if is_prepared(path):
        return _check_prepared(cfg, Path(path), tokenizer)
    if tokenizer:
        load_tokenizer(Path(tokenizer))
    if not path:
        return "the standard library's sources (the embedded default), bytes"
    p = Path(path)
    if not os.access(p, os.R_OK):
        raise ValueError(f"--data {path!r} cannot be read (permissions)")
    if p.is_dir():
        sizes = _folder_split(p, cfg.data.val_fraction)
    elif p.suffix == ".bin":
        sizes = _bin_split(p, cfg)
    else:
        check_is_text(p)
        n = p.stat().st_size
        held = max(1, int(n * cfg.data.val_fraction))
        sizes = (n - held, held)
    _check_enough(path, sizes, cfg, upper_bound=bool(tokenizer))
    unit = "ids" if p.suffix == ".bin" else "bytes"
    unit += f", encoded with {tokenizer}" if tokenizer else ""
    return f"{path}: {sizes[0]:,} training and {sizes[1]:,} held-out {unit}"


def _folder_split(p: Path, val_fraction: float) -> tuple[int, int]:
    files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES)
    if not files:
        suffixes = " ".join(sorted(TEXT_SUFFIXES))
        raise ValueError(f"--data {str(p)!r} holds no text files (suffixes: {suffixes})")
    split = [0, 0]
    for f in files:
        split[is_val_file(f.relative_to(p).as_posix(), val_fraction)] += f.stat().st_size
    if not split[0] or not split[1]:  # too few files for a split by file: the tail
        n = sum(split)
        return n - max(1, int(n * val_fraction)), max(1, int(n * val_fraction))
    return split[0], split[1]


def _bin_split(p: Path, cfg: Any) -> tuple[int, int]:
    size = p.stat().st_size
    if size % 2:
        raise ValueError(f"--data {str(p)!r} has {size} bytes, not a whole number of uint16 ids")
    ids = np.memmap(p, dtype=np.uint16, mode="r") if size else np.zeros(0, dtype=np.uint16)
    highest = _max_id(ids, p)
    if highest >= cfg.model.vocab_size:
        raise ValueError(
            f"--data {str(p)!r} has token ids up to {highest}, the model's vocabulary is "
            f"{cfg.model.vocab_size}; use --vocab-size {highest + 1} or more"
        )
    n = len(ids)
    return n - max(1, int(n * cfg.data.val_fraction)), max(1, int(n * cfg.data.val_fraction))


def _max_id(ids: np.ndarray, p: Path) -> int:
    from tqdm import tqdm

    highest = -1
    chunks = range(0, len(ids), CHUNK)
    bar = tqdm(chunks, desc=f"checking {p.name}", unit="chunk", delay=1.0, leave=False,
               disable=not sys.stderr.isatty())  # fmt: skip
    for start in bar:  # the bar's frames only on a terminal, not into a log
        highest = max(highest, int(ids[start : start + CHUNK].max()))
    return highest


def _check_enough(path: str, sizes: tuple[int, int], cfg: Any, upper_bound: bool) -> None:
    """Enough tokens for one training window and one validation batch. With a tokenizer
    the sizes are bytes, an upper bound on the tokens: only a sure shortage is refused."""
    train, val = sizes
    t = cfg.train
    need_train, need_val = t.seq_len + 1, t.micro_batch * t.seq_len + 1
    if train + val == 0:
        raise ValueError(f"--data {path!r} is empty; give text, or a .bin of uint16 ids")
    what = "bytes" if upper_bound else "tokens"
    if train < need_train:
        raise ValueError(
            f"--data {path!r} leaves {train} training {what}, fewer than one sequence of "
            f"seq_len + 1 = {need_train}; give more data or a shorter --seq-len"
        )
    if t.val_batches and val < need_val:
        raise ValueError(
            f"--data {path!r} holds out {val} {what} for validation, fewer than one batch of "
            f"micro_batch * seq_len + 1 = {need_val}; give more data, a larger "
            "--val-fraction, or --val-batches 0"
        )


def _check_prepared(cfg: Any, path: Path, tokenizer: str) -> str:
    meta = read_data_meta(path)  # every shard's size against the index
    if tokenizer:
        digest = hashlib.sha256(Path(tokenizer).read_bytes()).hexdigest()
        if digest != meta["tokenizer_sha256"]:
            raise ValueError(
                f"--tokenizer {tokenizer!r} is not the one {str(path)!r} was prepared with; "
                "leave --tokenizer out (the data set has its own)"
            )
    if meta["vocab_size"] > cfg.model.vocab_size:
        raise ValueError(
            f"--data {str(path)!r} was prepared with a vocabulary of {meta['vocab_size']}, "
            f"the model's is {cfg.model.vocab_size}; leave --vocab-size out or raise it"
        )
    n = meta["tokens"]
    supervised = meta.get("format", "text") != "text"
    if run_row_layout(cfg, supervised) != "stream":
        _check_documents(path, meta, cfg)
    else:
        _check_enough(str(path), (n["train"], n["val"]), cfg, False)
    kind = f"{meta['format']} examples, " if supervised else ""
    return f"prepared {path}: {kind}{n['train']:,} training and {n['val']:,} held-out tokens"


def _check_documents(path: Path, meta: dict[str, Any], cfg: Any) -> None:
    """Rows of whole documents: the lengths recorded, a document to train on, and a
    validation batch of documents (packed, they may fill fewer rows)."""
    if not all("docs" in shard[s] for shard in meta["shards"] for s in ("train", "val")):
        raise ValueError(
            f"--data {str(path)!r} was prepared before documents' lengths were recorded, "
            f"which --packing {cfg.data.packing} needs; prepare it again"
        )
    docs, t = meta["documents"], cfg.train
    if docs["train"] < 1:
        raise ValueError(f"--data {str(path)!r} holds no training document")
    if t.val_batches and docs["val"] < t.micro_batch:
        raise ValueError(
            f"--data {str(path)!r} holds out {docs['val']} documents, fewer than one "
            f"batch of --micro-batch {t.micro_batch}; give more data, a larger "
            "--val-fraction at prepare, or --val-batches 0"
        )
