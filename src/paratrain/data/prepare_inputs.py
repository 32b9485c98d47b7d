"""What `paratrain prepare` reads (prepare.py): the inputs cut into pieces, and each piece's
documents with the key that decides their split.

A piece is a whole file, or a run of whole lines of a large JSON-lines file. A text file
is one document; a JSON-lines line is one unless blank: its `text` (--format text) or the
whole object, a supervised example (supervised.py).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def held_out(key: str, val_fraction: float) -> bool:
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < val_fraction


@dataclass(frozen=True)
class FileRange:
    """Bytes [start, end) of one input file: all of it, or a run of whole lines."""

    source: str  # the input file
    key: str  # its path relative to --data: its documents' split is hashed from it
    start: int
    end: int
    first_doc: int = 0  # documents before `start` (a document's n counts from the file's start)
    first_line: int = 1  # the line at `start`, for error messages

    @property
    def size(self) -> int:
        return self.end - self.start


def pieces_of(f: Path, key: str, job_bytes: int) -> list[FileRange]:
    size = f.stat().st_size
    if f.suffix != ".jsonl" or size <= job_bytes:
        return [FileRange(str(f), key, 0, size)]
    pieces, start, first_doc, first_line = [], 0, 0, 1
    at, docs, lines = 0, 0, 0
    with f.open("rb") as rows:
        for row in rows:  # lines end at b"\n" only, as _documents reads them
            if at - start >= job_bytes:
                pieces.append(FileRange(str(f), key, start, at, first_doc, first_line))
                start, first_doc, first_line = at, docs, lines + 1
            at, docs, lines = at + len(row), docs + bool(row.strip()), lines + 1
    return [*pieces, FileRange(str(f), key, start, at, first_doc, first_line)]


def group_pieces(pieces: list[FileRange], job_bytes: int) -> list[tuple[FileRange, ...]]:
    """Consecutive pieces, in order, up to job_bytes a job (a larger piece alone)."""
    jobs: list[tuple[FileRange, ...]] = []
    current: list[FileRange] = []
    held = 0  # current's bytes
    for p in pieces:
        if current and held + p.size > job_bytes:
            jobs.append(tuple(current))
            current, held = [], 0
        current.append(p)
        held += p.size
    return [*jobs, tuple(current)] if current else jobs


def documents_of(p: FileRange, fmt: str = "text") -> Iterator[tuple[str, str, Any]]:
    """(split key, where, document) of each document of a piece: a text file's text, a
    JSON-lines line's `text` (fmt "text") or its object (a supervised example)."""
    f = Path(p.source)
    if f.suffix != ".jsonl":
        if fmt != "text":
            raise ValueError(f"--format {fmt} reads JSON lines (.jsonl); {f} is text")
        yield f"{p.key}:0", str(f), f.read_text(errors="replace")
        return
    with f.open("rb") as rows:
        rows.seek(p.start)
        data = rows.read(p.end - p.start)
    n = p.first_doc
    for number, row in enumerate(data.split(b"\n"), start=p.first_line):
        if row.strip():
            doc = _json(row, f, number)
            yield f"{p.key}:{n}", f"{f}:{number}", _text(doc, f, number) if fmt == "text" else doc
            n += 1


def _json(row: bytes, f: Path, number: int) -> Any:
    try:
        return json.loads(row.decode())
    except ValueError as e:  # not UTF-8, or not JSON
        raise ValueError(f"{f}:{number}: not a line of JSON ({e})") from None


def _text(doc: Any, f: Path, number: int) -> str:
    if not isinstance(doc, dict) or not isinstance(doc.get("text"), str):
        raise ValueError(f"{f}:{number}: a JSON-lines document needs a string field 'text'")
    return str(doc["text"])  # a str already: checked above
