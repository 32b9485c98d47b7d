"""`paratrain prepare`: text -> token shards on disk, which training reads through memory
maps, so a corpus larger than memory trains in constant memory.

    paratrain prepare --data corpus/ --tokenizer tokenizer.json --out data/corpus

Input: a text file, a JSON-lines file (each line's `text`), or a folder of them. Each input
file is one job, run in parallel worker processes; its documents are encoded with the
tokenizer, `<|endoftext|>` after each, and go to the held-out split when the hash of
(file, line) says so (a document's split never depends on the others). A job writes
`train_NNNNN.bin` and `val_NNNNN.bin` (uint16 ids when the vocabulary fits, else uint32)
and then its `shard_NNNNN.json`: documents, tokens and each document's length. A job whose
record is there and whose files have the recorded sizes is done; an interrupted run, run
again, does only the rest and writes the same bytes as an uninterrupted one. `meta.json`
(the tokenizer's hash, the vocabulary, the dtype, every shard's counts) is written last:
a directory without it is not a data set.
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
import torch

from paratrain.train.tokenizer import EOT, eot_id, load_tokenizer, text_files

META = "meta.json"
TOKENIZER_COPY = "tokenizer.json"
SPLITS = ("train", "val")


def _inputs(path: Path) -> list[Path]:
    if path.is_dir():
        files = text_files(path)
        if not files:
            raise ValueError(f"--data {str(path)!r} holds no text or JSON-lines files")
        return files
    if not path.is_file():
        raise ValueError(f"--data {str(path)!r} does not exist; give a text or JSON-lines file")
    return [path]


def _held_out(key: str, val_fraction: float) -> bool:
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < val_fraction


def _documents(f: Path) -> list[str]:
    if f.suffix != ".jsonl":
        return [f.read_text(errors="replace")]
    docs = []
    for n, line in enumerate(f.read_text().splitlines(), start=1):
        if line.strip():
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                raise ValueError(f"{f}:{n}: a JSON-lines document needs a string field 'text'")
            docs.append(row["text"])
    return docs


@dataclass(frozen=True)
class Job:
    index: int
    source: str  # the input file
    key: str  # its path relative to --data: the documents' split is hashed from it
    out: str
    tokenizer: str
    dtype: str
    val_fraction: float


def _record(job: Job) -> Path:
    return Path(job.out) / f"shard_{job.index:05d}.json"


def _done(job: Job) -> bool:
    record = _record(job)
    if not record.is_file():
        return False
    counts = json.loads(record.read_text())
    itemsize = np.dtype(job.dtype).itemsize
    return all(
        (Path(job.out) / counts[s]["file"]).is_file()
        and (Path(job.out) / counts[s]["file"]).stat().st_size == counts[s]["tokens"] * itemsize
        for s in SPLITS
    )


def run_job(job: Job) -> dict[str, Any]:
    """Encode one input file into its train and val shards, then record them."""
    tokenizer = load_tokenizer(Path(job.tokenizer))
    eot = eot_id(tokenizer)
    ids: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
    lengths: dict[str, list[int]] = {s: [] for s in SPLITS}
    for n, text in enumerate(_documents(Path(job.source))):
        split = "val" if _held_out(f"{job.key}:{n}", job.val_fraction) else "train"
        doc = tokenizer.encode(text).ids + [eot]
        ids[split].append(np.asarray(doc, dtype=job.dtype))
        lengths[split].append(len(doc))
    counts = {}
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
) -> dict[str, Any]:
    """Tokenize `data` into shards in `out` (resuming a run interrupted there); return
    meta.json's contents."""
    if not 0 <= val_fraction < 1:  # written so that NaN fails
        raise ValueError(f"--val-fraction {val_fraction}: at least 0 and below 1")
    tokenizer = load_tokenizer(tokenizer_file)
    if eot_id(tokenizer) is None:
        raise ValueError(f"--tokenizer {str(tokenizer_file)!r} has no {EOT} token")
    vocab = tokenizer.get_vocab_size()
    digest = hashlib.sha256(tokenizer_file.read_bytes()).hexdigest()
    if (out / META).is_file():
        raise ValueError(f"--out {out} is already a prepared data set; give a new directory")
    out.mkdir(parents=True, exist_ok=True)
    started = out / "prepare.json"  # what an interrupted run was doing: it must not change
    settings = {"data": str(data.resolve()), "tokenizer_sha256": digest, "val": val_fraction}
    if started.is_file() and json.loads(started.read_text()) != settings:
        raise ValueError(f"--out {out} holds an interrupted prepare of other inputs")
    started.write_text(json.dumps(settings) + "\n")
    dtype = "uint16" if vocab <= 2**16 else "uint32"
    root = data if data.is_dir() else data.parent
    jobs = [
        Job(
            i,
            str(f),
            f.relative_to(root).as_posix(),
            str(out),
            str(tokenizer_file),
            dtype,
            val_fraction,
        )  # fmt: skip
        for i, f in enumerate(_inputs(data))
    ]
    todo = [j for j in jobs if not _done(j)]
    _run(todo, workers or min(len(todo), os.cpu_count() or 1), progress)
    shards = [json.loads(_record(j).read_text()) for j in jobs]
    meta = {
        "tokenizer_sha256": digest,
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


def _run(jobs: list[Job], workers: int, progress: bool) -> None:
    if not jobs:
        return
    from tqdm import tqdm

    bar = tqdm(total=len(jobs), unit="file", disable=not progress, desc="prepare")
    if workers <= 1:
        for job in jobs:
            run_job(job)
            bar.update()
    else:  # spawned, not forked: the tokenizer library's threads do not survive a fork
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(workers, mp_context=context) as pool:
            for done in as_completed([pool.submit(run_job, job) for job in jobs]):
                done.result()
                bar.update()
    bar.close()


class ShardedTokens:
    """The shards of one split as one 1-D sequence of token ids, read through memory maps:
    `len()` and slicing (what the batch sampler does), each slice a small int64 tensor."""

    def __init__(self, paths: list[Path], dtype: str) -> None:
        maps = [np.memmap(p, dtype=dtype, mode="r") for p in paths if p.stat().st_size]
        self.maps = maps
        self.starts = np.cumsum([0] + [len(m) for m in maps])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, index: slice) -> torch.Tensor:
        start, stop, _ = index.indices(len(self))
        pieces = []
        shard = int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < stop:
            lo = start - int(self.starts[shard])
            hi = min(stop, int(self.starts[shard + 1])) - int(self.starts[shard])
            pieces.append(np.asarray(self.maps[shard][lo:hi], dtype=np.int64))
            start += hi - lo
            shard += 1
        joined = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
        return torch.from_numpy(joined)


def read_meta(path: Path) -> dict[str, Any]:
    """A prepared data set's meta.json, every shard checked whole; ValueError otherwise."""
    if not (path / META).is_file():
        raise ValueError(f"--data {str(path)!r}: no {META}; run paratrain prepare (again)")
    meta = json.loads((path / META).read_text())
    itemsize = np.dtype(meta["dtype"]).itemsize
    for shard in meta["shards"]:
        for s in SPLITS:
            f = path / shard[s]["file"]
            size = f.stat().st_size if f.is_file() else -1
            if size != shard[s]["tokens"] * itemsize:
                raise ValueError(
                    f"--data {str(path)!r}: shard {f.name} has {size} bytes, its index says "
                    f"{shard[s]['tokens'] * itemsize}; prepare the data again"
                )
    return meta


def is_prepared(path: str) -> bool:
    return bool(path) and (Path(path) / META).is_file()
