"""Tokenizers: byte-level BPE trained here with Hugging Face's `tokenizers`, any
`tokenizer.json` read, and the vocabulary padded for tensor parallelism.

    paratrain tokenizer train --data corpus/ --vocab-size 8192 --out tokenizer.json

Bytes stay the zero-setup default (256 ids, no file). A BPE built here is byte-level (any
text encodes, nothing is unknown) and reserves `<|endoftext|>`, which `paratrain prepare`
puts between documents.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

EOT = "<|endoftext|>"
# What a folder's text is: these files (and .jsonl documents); anything else is skipped.
TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst", ".c", ".h", ".json", ".toml", ".cfg", ".html"}
PAD_MULTIPLE = 128  # vocabulary rows: a multiple that every tp up to 128 divides


def padded_vocab(vocab: int) -> int:
    """The model's vocabulary for a tokenizer of `vocab` ids: rounded up to PAD_MULTIPLE
    so that tensor parallelism splits the embedding and the head evenly. The padding ids
    never occur in the data; sampling never draws them (trained/run_model.py)."""
    return -(-vocab // PAD_MULTIPLE) * PAD_MULTIPLE


def documents(path: Path) -> Iterator[str]:
    """The documents of a text file, a JSON-lines file (each line's `text`), or a folder of
    them (sorted, recursively): what the tokenizer trains on and `prepare` encodes."""
    files = text_files(path) if path.is_dir() else [path]
    for f in files:
        if f.suffix == ".jsonl":
            for n, line in enumerate(f.read_text().splitlines(), start=1):
                if line.strip():
                    yield _text_of(json.loads(line), f, n)
        else:
            yield f.read_text(errors="replace")


def text_files(folder: Path) -> list[Path]:
    """A folder's text files (TEXT_SUFFIXES) and JSON-lines files, sorted, recursively."""
    wanted = TEXT_SUFFIXES | {".jsonl"}
    return sorted(f for f in folder.rglob("*") if f.is_file() and f.suffix in wanted)


def input_files(path: Path) -> list[Path]:
    """The files of --data (a file, or a folder's text and JSON-lines files); ValueError
    naming the path when there are none."""
    if path.is_dir():
        files = text_files(path)
        if not files:
            raise ValueError(f"--data {str(path)!r} holds no text or JSON-lines files")
        return files
    if not path.is_file():
        raise ValueError(f"--data {str(path)!r} does not exist; give a text or JSON-lines file")
    return [path]


def _text_of(row: Any, f: Path, n: int) -> str:
    if not isinstance(row, dict) or not isinstance(row.get("text"), str):
        raise ValueError(f"{f}:{n}: a JSON-lines document needs a string field 'text'")
    text: str = row["text"]
    return text


def train_tokenizer(data: Path, vocab_size: int, out: Path) -> int:
    """A byte-level BPE of `vocab_size` ids (EOT included) trained on `data`; returns the
    vocabulary size it reached."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if not 256 < vocab_size <= 2**32:
        raise ValueError(f"--vocab-size {vocab_size}: more than the 256 bytes, at most 2^32")
    if out.exists():
        raise ValueError(f"--out {out} already exists; give a new file name")
    size = sum(f.stat().st_size for f in input_files(data))
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte: nothing unknown
        show_progress=False,
    )
    bpe.train_from_iterator(documents(data), trainer)
    reached = bpe.get_vocab_size()
    if reached < vocab_size:  # BPE stops when no pair repeats: the text was too small
        raise ValueError(
            f"--data {str(data)!r}: {size:,} bytes of text give only {reached} ids, fewer than "
            f"--vocab-size {vocab_size}; give more text, or --vocab-size {reached} or less"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    bpe.save(str(out))
    return bpe.get_vocab_size()


def load_tokenizer(path: Path) -> Any:
    """A Hugging Face `tokenizer.json`; ValueError in one line if it is not one."""
    from tokenizers import Tokenizer

    if not path.is_file():
        raise ValueError(f"--tokenizer {str(path)!r} does not exist; give a tokenizer.json")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the library raises its own exception types
        raise ValueError(f"--tokenizer {str(path)!r} is not a tokenizer.json: {e}") from None


def eot_id(tokenizer: Any) -> int | None:
    token: int | None = tokenizer.token_to_id(EOT)
    return token
