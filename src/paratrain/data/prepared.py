"""A prepared data set read back (`paratrain prepare` writes it: prepare.py): its index,
`meta.json`, every shard checked whole against it, and a split's shards as one sequence
of token ids through memory maps, so a corpus larger than memory trains in constant
memory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

META = "meta.json"
TOKENIZER_COPY = "tokenizer.json"
SPLITS = ("train", "val")


class ShardedTokens:
    """The shards of one split as one 1-D sequence of token ids, read through memory maps:
    `len()` and slicing (what the batch sampler does), each slice a small int64 tensor.
    With loss masks (a supervised data set), a token that is no target reads as ~id
    (paratrain/token_rows.py)."""

    def __init__(self, paths: list[Path], dtype: str, masks: list[Path] | None = None) -> None:
        kept = [i for i, p in enumerate(paths) if p.stat().st_size]
        self.maps = [np.memmap(paths[i], dtype=dtype, mode="r") for i in kept]
        self.masks = [np.memmap(masks[i], dtype="uint8", mode="r") for i in kept] if masks else []
        self.starts = np.cumsum([0] + [len(m) for m in self.maps])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, index: slice) -> torch.Tensor:
        start, stop, _ = index.indices(len(self))
        pieces = []
        shard = int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < stop:
            lo = start - int(self.starts[shard])
            hi = min(stop, int(self.starts[shard + 1])) - int(self.starts[shard])
            ids = np.asarray(self.maps[shard][lo:hi], dtype=np.int64)
            if self.masks:
                ids = np.where(self.masks[shard][lo:hi].astype(bool), ids, ~ids)
            pieces.append(ids)
            start += hi - lo
            shard += 1
        joined = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
        import torch  # here: checking or preparing data (this module) needs no torch

        return torch.from_numpy(joined)


def shard_files(entry: dict[str, Any], dtype: str) -> list[tuple[str, int]]:
    """(file, bytes) of one split of one shard, as its index entry names them: the ids, and
    where written (data sets prepared before them have neither) the documents' lengths
    and the loss mask."""
    files = [(entry["file"], entry["tokens"] * np.dtype(dtype).itemsize)]
    if "docs" in entry:
        files.append((entry["docs"], entry["documents"] * 8))
    if "mask" in entry:
        files.append((entry["mask"], entry["tokens"]))
    return files


def read_data_meta(path: Path) -> dict[str, Any]:
    """A prepared data set's meta.json, every shard checked whole; ValueError otherwise."""
    if not (path / META).is_file():
        raise ValueError(f"--data {str(path)!r}: no {META}; run paratrain prepare (again)")
    meta: dict[str, Any] = json.loads((path / META).read_text())
    for shard in meta["shards"]:
        for s in SPLITS:
            for name, expected in shard_files(shard[s], meta["dtype"]):
                f = path / name
                size = f.stat().st_size if f.is_file() else -1
                if size != expected:
                    raise ValueError(
                        f"--data {str(path)!r}: shard {f.name} has {size} bytes, its index "
                        f"says {expected}; prepare the data again"
                    )
    return meta


def document_lengths(path: Path, meta: dict[str, Any], split: str) -> np.ndarray | None:
    """Each document's length in tokens, in the split's order; None for a data set prepared
    before the lengths were written."""
    entries = [shard[split] for shard in meta["shards"]]
    if not all("docs" in e for e in entries):
        return None
    parts = [np.fromfile(path / e["docs"], dtype=np.int64) for e in entries]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def is_prepared(path: str) -> bool:
    return bool(path) and (Path(path) / META).is_file()
