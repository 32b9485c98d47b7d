"""`paratrain prepare`: text -> token shards on disk, which training reads through memory
maps, so a corpus larger than memory trains in constant memory.

    paratrain prepare --data corpus/ --tokenizer tokenizer.json --out data/corpus

Input: a text file, a JSON-lines file (each line's `text`, or under a supervised
`--format` each line an example), or a folder of them. The sorted inputs are cut into
pieces, a whole file each, except that a JSON-lines file over JOB_BYTES is cut at line
starts into runs of lines of at least JOB_BYTES; consecutive pieces are then grouped
into jobs of at most JOB_BYTES (a larger piece is a job of its own). So the jobs depend
only on the sorted listing, the file sizes and where a large file's lines start, never
on the worker count or on timing. Worker processes, each with the tokenizer loaded once,
run the jobs. A job encodes its documents, `<|endoftext|>` after each, and sends one to
the held-out split when the hash of (file, n) says so, n counting the documents from the
start of the file, whichever piece holds it (a document's split never depends on the
others or on the cuts). Job k writes `train_k.bin` and `val_k.bin` (k as five digits;
uint16 ids when the vocabulary fits, else uint32), `train_k.docs` and `val_k.docs` (each
document's length, int64), under a supervised `--format` (chat, prompt-completion:
supervised.py) `train_k.mask` and `val_k.mask` (a byte per token, 1 where it is a loss
target), and then its record `shard_k.json`: the pieces it read, documents, tokens and
each document's length. The shards, read in order, hold the documents in the sorted
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
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from paratrain.data.chat_template import KEPT, ChatTemplate, template_source
from paratrain.data.prepare_inputs import (
    FileRange,
    documents_of,
    group_pieces,
    held_out,
    pieces_of,
)
from paratrain.data.prepared import META, SPLITS, TOKENIZER_COPY, shard_files
from paratrain.data.supervised import FORMATS, render
from paratrain.data.tokenizer import EOT, eot_id, input_files, load_tokenizer

# Input bytes per job: a few seconds of encoding, beside which a job's own costs (a round
# trip to a worker, three files) vanish; a few hundred MB still make dozens of jobs for
# the workers to share, and an interrupted run loses at most one job per worker.
JOB_BYTES = 8 << 20


@dataclass(frozen=True)
class Job:
    index: int
    pieces: tuple[FileRange, ...]
    out: str
    dtype: str
    val_fraction: float
    fmt: str = "text"  # supervised formats also write each token's loss mask
    template: dict[str, Any] | None = None  # a chat's: the tokenizer's (chat_template.py)

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
    return counts.get("inputs") == job.inputs and all(
        (Path(job.out) / name).is_file() and (Path(job.out) / name).stat().st_size == size
        for s in SPLITS
        for name, size in shard_files(counts[s], job.dtype)
    )


def _encoded(job: Job, tokenizer: Any, eot: int) -> dict[str, list[tuple[list[int], list[int]]]]:
    """Each split's documents as (ids, loss mask); text has every token a target."""
    docs: dict[str, list[tuple[list[int], list[int]]]] = {s: [] for s in SPLITS}
    template = ChatTemplate(job.template) if job.template is not None else None
    # One document a call: encode_batch spent the same CPU per token here (4 MB of the
    # standard library), and its threads would only compete with the other workers.
    for key, where, doc in (d for p in job.pieces for d in documents_of(p, job.fmt)):
        split = "val" if held_out(key, job.val_fraction) else "train"
        if job.fmt == "text":
            ids = tokenizer.encode(doc).ids + [eot]
            docs[split].append((ids, []))
            continue
        try:
            docs[split].append(render(doc, job.fmt, tokenizer, eot, template))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    return docs


def _write(path: Path, arrays: list[np.ndarray], dtype: str) -> int:
    """The arrays joined into `path` (written whole or not at all); its element count."""
    data = np.concatenate(arrays) if arrays else np.zeros(0, dtype=dtype)
    tmp = path.with_name(path.name + ".tmp")
    data.astype(dtype).tofile(tmp)
    tmp.replace(path)
    return int(data.size)


def run_job(job: Job, tokenizer: Any) -> dict[str, Any]:
    """Encode one job's documents into its train and val shards, then record them."""
    eot = eot_id(tokenizer)
    assert eot is not None  # prepare refuses a tokenizer without <|endoftext|>
    docs = _encoded(job, tokenizer, eot)
    counts: dict[str, Any] = {"inputs": job.inputs}
    for s in SPLITS:
        out, stem = Path(job.out), f"{s}_{job.index:05d}"
        ids = [np.asarray(i, dtype=job.dtype) for i, _ in docs[s]]
        tokens = _write(out / f"{stem}.bin", ids, job.dtype)
        counts[s] = {"file": f"{stem}.bin", "documents": len(ids), "tokens": tokens}
        lengths = [len(i) for i in ids]
        _write(out / f"{stem}.docs", [np.asarray(lengths, dtype="int64")], "int64")
        counts[s]["docs"] = f"{stem}.docs"  # each document's length, in order
        if job.fmt != "text":  # 1 where the token is a loss target, beside the ids
            masks = [np.asarray(m, dtype="uint8") for _, m in docs[s]]
            _write(out / f"{stem}.mask", masks, "uint8")
            counts[s]["mask"] = f"{stem}.mask"
        counts[s]["lengths"] = lengths
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
    fmt: str = "text",
    chat_template: str = "auto",
) -> dict[str, Any]:
    """Tokenize `data` into shards in `out` (resuming a run interrupted there); return
    meta.json's contents. fmt: text, or a supervised format (supervised.py); a chat is
    rendered by `chat_template` (chat_template.CHOICES)."""
    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r}; valid: {', '.join(FORMATS)}")
    if chat_template != "auto" and fmt != "chat":
        raise ValueError(f"--chat-template {chat_template} renders --format chat, not {fmt}")
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
        p
        for f in input_files(data)
        for p in pieces_of(f, f.relative_to(root).as_posix(), job_bytes)
    ]
    settings = {"data": str(data.resolve()), "tokenizer_sha256": digest, "val": val_fraction}
    settings["job_bytes"] = job_bytes  # the jobs' boundaries follow from it
    settings["format"] = fmt
    settings["chat_template"] = (
        template_source(tokenizer_file, chat_template) if fmt == "chat" else None
    )
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
        Job(i, group, str(out), dtype, val_fraction, settings["format"], settings["chat_template"])
        for i, group in enumerate(group_pieces(pieces, settings["job_bytes"]))
    ]
    todo = [j for j in jobs if not _done(j)]
    _run(todo, workers or min(len(todo), os.cpu_count() or 1), tokenizer_file, progress)
    shards = [json.loads(_record(j).read_text()) for j in jobs]
    meta = {
        "tokenizer_sha256": settings["tokenizer_sha256"],
        "vocab_size": vocab,
        "eot": eot_id(tokenizer),
        "dtype": dtype,
        "format": settings["format"],
        "chat_template": "tokenizer" if settings["chat_template"] else "default",
        "val_fraction": val_fraction,
        "shards": [
            {s: {k: v for k, v in c[s].items() if k != "lengths"} for s in SPLITS} for c in shards
        ],  # fmt: skip
        "tokens": {s: sum(c[s]["tokens"] for c in shards) for s in SPLITS},
        "documents": {s: sum(c[s]["documents"] for c in shards) for s in SPLITS},
    }
    shutil.copy2(tokenizer_file, out / TOKENIZER_COPY)
    if settings["format"] == "chat":  # what `sample --chat` renders a prompt with
        kept = settings["chat_template"] or {"template": None}
        (out / KEPT).write_text(json.dumps(kept) + "\n")
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
