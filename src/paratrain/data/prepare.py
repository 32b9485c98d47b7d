"""`paratrain prepare`: text -> token shards on disk, which training reads through memory
maps, so a corpus larger than memory trains in constant memory.

    paratrain prepare --data corpus/ --tokenizer tokenizer.json --out data/corpus

Input: a text file, a JSON-lines file (each line's `text`), or a folder of them. The
sorted inputs are cut into pieces, a whole file each, except that a JSON-lines file over
JOB_BYTES is cut at line starts into runs of lines of at least JOB_BYTES; consecutive
pieces are then grouped into jobs of at most JOB_BYTES (a larger piece is a job of its
own). So the jobs depend only on the sorted listing, the file sizes and where a large
file's lines start, never on the worker count or on timing. Worker processes, each with
the tokenizer loaded once, run the jobs. A job encodes its documents, `<|endoftext|>`
after each, and sends one to the held-out split when the hash of (file, n) says so, n
counting the documents from the start of the file, whichever piece holds it (a
document's split never depends on the others or on the cuts). Job k writes
`train_k.bin` and `val_k.bin` (k as five digits; uint16 ids when the vocabulary fits,
else uint32) and then its record `shard_k.json`: the pieces it read, documents, tokens
and each document's length. The shards, read in order, hold the documents in the sorted
inputs' order. A job whose record names its pieces and whose files have the recorded
sizes is done; an interrupted run, run again, does only the rest and writes the same
bytes as an uninterrupted one. `meta.json` (the tokenizer's hash, the vocabulary, the
dtype, every shard's counts) is written last: a directory without it is not a data set.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from paratrain.data.prepared import META, SPLITS, TOKENIZER_COPY
from paratrain.data.tokenizer import EOT, eot_id, input_files, load_tokenizer

# Input bytes per job: a few seconds of encoding, beside which a job's own costs (a round
# trip to a worker, three files) vanish; a few hundred MB still make dozens of jobs for
# the workers to share, and an interrupted run loses at most one job per worker.
JOB_BYTES = 8 << 20


def _held_out(key: str, val_fraction: float) -> bool:
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


def _pieces(f: Path, key: str, job_bytes: int) -> list[FileRange]:
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


def _group(pieces: list[FileRange], job_bytes: int) -> list[tuple[FileRange, ...]]:
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


def _documents(p: FileRange) -> Iterator[tuple[str, str]]:
    """(split key, text) of each document of a piece: a text file is one document, a
    JSON-lines line one unless blank."""
    f = Path(p.source)
    if f.suffix != ".jsonl":
        yield f"{p.key}:0", f.read_text(errors="replace")
        return
    with f.open("rb") as rows:
        rows.seek(p.start)
        data = rows.read(p.end - p.start)
    n = p.first_doc
    for number, row in enumerate(data.split(b"\n"), start=p.first_line):
        if row.strip():
            yield f"{p.key}:{n}", _text(row, f, number)
            n += 1


def _text(row: bytes, f: Path, number: int) -> str:
    try:
        doc = json.loads(row.decode())
    except ValueError as e:  # not UTF-8, or not JSON
        raise ValueError(f"{f}:{number}: not a line of JSON ({e})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("text"), str):
        raise ValueError(f"{f}:{number}: a JSON-lines document needs a string field 'text'")
    return str(doc["text"])  # a str already: checked above


@dataclass(frozen=True)
class Job:
    index: int
    pieces: tuple[FileRange, ...]
    out: str
    dtype: str
    val_fraction: float

    @property
    def inputs(self) -> list[list[Any]]:
        """What the job reads, as its record lists it."""
        return [[p.key, p.start, p.end] for p in self.pieces]

    @property
    def size(self) -> int:
        return sum(p.size for p in self.pieces)


def _record(job: Job) -> Path:
    return Path(job.out) / f"shard_{job.index:05d}.json"


def _done(job: Job) -> bool:
    record = _record(job)
    if not record.is_file():
        return False
    counts = json.loads(record.read_text())
    itemsize = np.dtype(job.dtype).itemsize
    return counts.get("inputs") == job.inputs and all(
        (Path(job.out) / counts[s]["file"]).is_file()
        and (Path(job.out) / counts[s]["file"]).stat().st_size == counts[s]["tokens"] * itemsize
        for s in SPLITS
    )


def run_job(job: Job, tokenizer: Any) -> dict[str, Any]:
    """Encode one job's documents into its train and val shards, then record them."""
    eot = eot_id(tokenizer)
    ids: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
    lengths: dict[str, list[int]] = {s: [] for s in SPLITS}
    # One document a call: encode_batch spent the same CPU per token here (4 MB of the
    # standard library), and its threads would only compete with the other workers.
    for key, text in (doc for p in job.pieces for doc in _documents(p)):
        split = "val" if _held_out(key, job.val_fraction) else "train"
        ids[split].append(np.asarray(tokenizer.encode(text).ids + [eot], dtype=job.dtype))
        lengths[split].append(len(ids[split][-1]))
    counts: dict[str, Any] = {"inputs": job.inputs}
    for s in SPLITS:
        name = f"{s}_{job.index:05d}.bin"
        tmp = Path(job.out) / (name + ".tmp")
        data = np.concatenate(ids[s]) if ids[s] else np.zeros(0, dtype=job.dtype)
        data.tofile(tmp)
        tmp.replace(Path(job.out) / name)
        counts[s] = {"file": name, "documents": len(lengths[s]), "tokens": int(data.size)}
        counts[s]["lengths"] = lengths[s]
    tmp = _record(job).with_suffix(".tmp")
    tmp.write_text(json.dumps(counts) + "\n")
    tmp.replace(_record(job))  # the job is done only now
    return counts


def prepare(
    data: Path,
    tokenizer_file: Path,
    out: Path,
    val_fraction: float = 0.05,
    workers: int = 0,
    progress: bool = True,
    job_bytes: int = JOB_BYTES,
) -> dict[str, Any]:
    """Tokenize `data` into shards in `out` (resuming a run interrupted there); return
    meta.json's contents."""
    if not 0 <= val_fraction < 1:  # written so that NaN fails
        raise ValueError(f"--val-fraction {val_fraction}: at least 0 and below 1")
    if job_bytes < 1:
        raise ValueError(f"job_bytes {job_bytes}: at least 1")
    tokenizer = load_tokenizer(tokenizer_file)
    if eot_id(tokenizer) is None:
        raise ValueError(f"--tokenizer {str(tokenizer_file)!r} has no {EOT} token")
    digest = hashlib.sha256(tokenizer_file.read_bytes()).hexdigest()
    if (out / META).is_file():
        raise ValueError(f"--out {out} is already a prepared data set; give a new directory")
    root = data if data.is_dir() else data.parent
    pieces = [  # refused before anything is written: data missing, or no text in it
        p for f in input_files(data) for p in _pieces(f, f.relative_to(root).as_posix(), job_bytes)
    ]
    settings = {"data": str(data.resolve()), "tokenizer_sha256": digest, "val": val_fraction}
    settings["job_bytes"] = job_bytes  # the jobs' boundaries follow from it
    created = not out.exists()
    try:
        return _prepare_into(out, pieces, tokenizer, tokenizer_file, settings, workers, progress)
    except ValueError:  # a refusal (a bad document) leaves no directory it made behind
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise


def _prepare_into(
    out: Path,
    pieces: list[FileRange],
    tokenizer: Any,
    tokenizer_file: Path,
    settings: dict[str, Any],
    workers: int,
    progress: bool,
) -> dict[str, Any]:
    """prepare's work once its inputs are checked; an interruption is resumed from `out`."""
    vocab, val_fraction = tokenizer.get_vocab_size(), settings["val"]
    out.mkdir(parents=True, exist_ok=True)
    started = out / "prepare.json"  # what an interrupted run was doing: it must not change
    if started.is_file() and json.loads(started.read_text()) != settings:
        raise ValueError(f"--out {out} holds an interrupted prepare of other inputs")
    started.write_text(json.dumps(settings) + "\n")
    dtype = "uint16" if vocab <= 2**16 else "uint32"
    jobs = [
        Job(i, group, str(out), dtype, val_fraction)
        for i, group in enumerate(_group(pieces, settings["job_bytes"]))
    ]
    todo = [j for j in jobs if not _done(j)]
    _run(todo, workers or min(len(todo), os.cpu_count() or 1), tokenizer_file, progress)
    shards = [json.loads(_record(j).read_text()) for j in jobs]
    meta = {
        "tokenizer_sha256": settings["tokenizer_sha256"],
        "vocab_size": vocab,
        "eot": eot_id(tokenizer),
        "dtype": dtype,
        "val_fraction": val_fraction,
        "shards": [
            {s: {k: v for k, v in c[s].items() if k != "lengths"} for s in SPLITS} for c in shards
        ],  # fmt: skip
        "tokens": {s: sum(c[s]["tokens"] for c in shards) for s in SPLITS},
        "documents": {s: sum(c[s]["documents"] for c in shards) for s in SPLITS},
    }
    shutil.copy2(tokenizer_file, out / TOKENIZER_COPY)
    (out / META).write_text(json.dumps(meta, indent=1) + "\n")  # the commit point
    started.unlink()
    return meta


# A worker process's tokenizer: set once by _start_worker, before its first job, so that
# the file is read once per worker and not once per job.
_WORKER: dict[str, Any] = {}


def _start_worker(tokenizer_file: str) -> None:
    _WORKER["tokenizer"] = load_tokenizer(Path(tokenizer_file))


def _run_in_worker(job: Job) -> None:
    run_job(job, _WORKER["tokenizer"])


def _run(jobs: list[Job], workers: int, tokenizer_file: Path, progress: bool) -> None:
    if not jobs:
        return
    from tqdm import tqdm

    total = sum(j.size for j in jobs)
    bar = tqdm(total=total, unit="B", unit_scale=True, disable=not progress, desc="prepare")
    if workers <= 1:
        tokenizer = load_tokenizer(tokenizer_file)
        for job in jobs:
            run_job(job, tokenizer)
            bar.update(job.size)
    else:  # spawned, not forked: the tokenizer library's threads do not survive a fork
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(
            workers, context, initializer=_start_worker, initargs=(str(tokenizer_file),)
        ) as pool:
            running = {pool.submit(_run_in_worker, job): job for job in jobs}
            for done in as_completed(running):
                done.result()
                bar.update(running[done].size)
    bar.close()
