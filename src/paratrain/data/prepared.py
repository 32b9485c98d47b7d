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
        import torch  # here: checking or preparing data (this module) needs no torch

        return torch.from_numpy(joined)


def read_data_meta(path: Path) -> dict[str, Any]:
    """A prepared data set's meta.json, every shard checked whole; ValueError otherwise."""
    if not (path / META).is_file():
        raise ValueError(f"--data {str(path)!r}: no {META}; run paratrain prepare (again)")
    meta: dict[str, Any] = json.loads((path / META).read_text())
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
