"""Token data: the embedded default (the Python standard library's own source), text files,
or a .bin of uint16 token ids; a deterministic split; a stateless batch sampler.

Training text is cut into non-overlapping windows of seq_len + 1 tokens. Each epoch visits
every window once, in an order drawn from (seed, epoch). Step s takes the next G windows of
that order: the global batch depends only on (seed, step), never on the parallel layout,
and data-parallel replica r takes rows [r * K * b, (r + 1) * K * b) of it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from paratrain.data.chat_template import KEPT
from paratrain.data.files import data_tokenizer, is_val_file
from paratrain.data.prepared import (
    ShardedTokens,
    document_lengths,
    is_prepared,
    read_data_meta,
)
from paratrain.data.tokenizer import TEXT_SUFFIXES, documents, eot_id, load_tokenizer


@dataclass(frozen=True)
class TokenData:
    train: torch.Tensor  # 1-D token ids (uint8 for bytes, int32 for .bin)
    val: torch.Tensor
    vocab_size: int  # smallest vocabulary that covers the ids
    fingerprint: str  # sha256 over the sources, recorded with each run
    description: str
    # Each document's length (prepared data): one padded row per document, --packing none
    documents: dict[str, Any] | None = None  # {"train": lengths, "val": lengths}
    supervised: bool = False  # a loss mask rides in the ids (paratrain/token_rows.py)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _files_to_tokens(root: Path, files: list[Path], val_fraction: float, what: str) -> TokenData:
    h = hashlib.sha256()
    parts: dict[bool, list[bytes]] = {True: [], False: []}
    for f in files:
        rel = f.relative_to(root).as_posix()
        data = f.read_bytes()
        h.update(rel.encode() + b"\0" + data)
        parts[is_val_file(rel, val_fraction)].append(data)
    if not parts[True] or not parts[False]:
        # Too few files for a split by file: hold out the tail of the concatenation.
        joined = b"".join(parts[True] + parts[False])
        return _split_stream(_bytes(joined), 256, h.hexdigest(), what, val_fraction)
    train, val = _bytes(b"".join(parts[False])), _bytes(b"".join(parts[True]))
    desc = f"{what}: {len(files)} files, {len(train)} train / {len(val)} val bytes"
    return TokenData(train, val, 256, h.hexdigest(), desc)


def _bytes(b: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(b), dtype=torch.uint8)


def _split_stream(
    tokens: torch.Tensor, vocab: int, fingerprint: str, what: str, val_fraction: float
) -> TokenData:
    n_val = max(1, int(len(tokens) * val_fraction))
    train, val = tokens[:-n_val], tokens[-n_val:]
    desc = f"{what}: {len(train)} train / {len(val)} val tokens (tail held out)"
    return TokenData(train.clone(), val.clone(), vocab, fingerprint, desc)


def load_default(val_fraction: float = 0.05) -> TokenData:
    """Byte tokens of the standard library's .py files (tests and site-packages excluded)."""
    root = stdlib_root()
    skip = {"site-packages", "test", "tests", "__pycache__"}
    files = []
    # os.walk, pruned: rglob would list site-packages first (a second per process here)
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in skip]
        files += [Path(folder, n) for n in names if n.endswith(".py")]
    return _files_to_tokens(root, sorted(files), val_fraction, f"stdlib {root}")


def load_tokens(path: str, val_fraction: float = 0.05, tokenizer: str = "") -> TokenData:
    """Load the embedded default (empty path), a text file, a folder or a .bin of uint16 ids
    (bytes, or `tokenizer`'s ids for text), or a `paratrain prepare` directory (memory
    maps: its own split and tokenizer)."""
    if is_prepared(path):
        return _prepared(Path(path))
    if tokenizer:
        return _encoded(Path(path) if path else stdlib_root(), Path(tokenizer), val_fraction)
    if not path:
        return load_default(val_fraction)
    p = Path(path)
    if not p.exists():
        raise ValueError(f"--data {path!r} does not exist; give a text file, a folder or a .bin")
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES)
        if not files:
            suffixes = " ".join(sorted(TEXT_SUFFIXES))
            raise ValueError(f"--data {path!r} holds no text files (suffixes: {suffixes})")
        return _files_to_tokens(p, files, val_fraction, f"folder {p}")
    raw = p.read_bytes()
    fingerprint = hashlib.sha256(raw).hexdigest()
    if p.suffix == ".bin":
        if len(raw) % 2:
            raise ValueError(f"--data {path!r} has an odd size; a .bin holds uint16 token ids")
        ids = torch.frombuffer(bytearray(raw), dtype=torch.uint16).to(torch.int32)
        vocab = int(ids.max()) + 1 if len(ids) else 0
        return _split_stream(ids, vocab, fingerprint, f"token file {p}", val_fraction)
    return _split_stream(_bytes(raw), 256, fingerprint, f"text file {p}", val_fraction)


def _prepared(path: Path) -> TokenData:
    meta = read_data_meta(path)
    supervised = meta.get("format", "text") != "text"

    def split(s: str) -> ShardedTokens:
        files = [path / shard[s]["file"] for shard in meta["shards"]]
        masks = [path / shard[s]["mask"] for shard in meta["shards"]] if supervised else None
        return ShardedTokens(files, meta["dtype"], masks)

    splits = {s: split(s) for s in ("train", "val")}
    lengths = {s: document_lengths(path, meta, s) for s in ("train", "val")}
    documents = lengths if all(v is not None for v in lengths.values()) else None
    n = meta["tokens"]
    desc = f"prepared {path}: {n['train']:,} train / {n['val']:,} val tokens (memory-mapped)"
    fingerprint = hashlib.sha256((path / "meta.json").read_bytes()).hexdigest()
    # The splits are ShardedTokens (memory maps), sliced as the tensors the fields name are.
    return TokenData(
        splits["train"], splits["val"], meta["vocab_size"], fingerprint, desc,  # type: ignore[arg-type]
        documents, supervised,
    )  # fmt: skip


def _encoded(path: Path, tokenizer_file: Path, val_fraction: float) -> TokenData:
    """Text encoded with a tokenizer.json in memory, `<|endoftext|>` after each document
    (for corpora larger than memory: `paratrain prepare`)."""
    tokenizer = load_tokenizer(tokenizer_file)
    eot = eot_id(tokenizer)
    ids: list[int] = []
    h = hashlib.sha256(tokenizer_file.read_bytes())
    for text in documents(path):
        h.update(text.encode())
        ids += tokenizer.encode(text).ids + ([eot] if eot is not None else [])
    stream = torch.tensor(ids, dtype=torch.int32, device="cpu")  # host-side data
    vocab = tokenizer.get_vocab_size()
    return _split_stream(stream, vocab, h.hexdigest(), f"{path} ({tokenizer_file})", val_fraction)


class BatchSampler:
    """Stateless: `global_batch(step)` depends only on (seed, step).

    Returns (G, seq_len + 1) int64 token ids; inputs are [:, :-1], targets [:, 1:].
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, global_batch: int, seed: int) -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.seed = seed
        self.num_windows = (len(tokens) - 1) // seq_len
        if self.num_windows < 1:
            raise ValueError(
                f"the data has {len(tokens)} tokens, too few for one sequence of "
                f"seq_len + 1 = {seq_len + 1}; give more data or a shorter --seq-len"
            )
        self._epoch_order: tuple[int, torch.Tensor] | None = None

    def _order(self, epoch: int) -> torch.Tensor:
        if self._epoch_order is None or self._epoch_order[0] != epoch:
            # The data order is host-side: the same on every device, drawn on the CPU.
            g = torch.Generator(device="cpu").manual_seed(self.seed * 1_000_003 + epoch)
            order = torch.randperm(self.num_windows, generator=g, device="cpu")
            self._epoch_order = (epoch, order)
        return self._epoch_order[1]

    def epoch_of(self, step: int) -> int:
        return step * self.global_batch // self.num_windows

    def row(self, window: int) -> torch.Tensor:
        start = window * self.seq_len
        return self.tokens[start : start + self.seq_len + 1]

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows start to stop - 1 of the whole run's sequence (step s's global batch is
        rows s G to (s + 1) G - 1): (stop - start, T + 1) int64."""
        rows = []
        for i in range(start, stop):
            epoch, pos = divmod(i, self.num_windows)
            rows.append(self.row(int(self._order(epoch)[pos])))
        return torch.stack(rows).long()

    def global_batch_at(self, step: int) -> torch.Tensor:
        return self.rows(step * self.global_batch, (step + 1) * self.global_batch)  # (G, T + 1)

    def replica_microbatches(
        self, step: int, replica: int, num_replicas: int, micro_batch: int
    ) -> list[torch.Tensor]:
        """Replica r's K micro-batches of b rows each, from step's global batch. Only its
        own rows are read: the global batch, stacked whole, stayed alive behind the
        micro-batches' views, G rows on every rank (dp times its own)."""
        per_replica = self.global_batch // num_replicas
        first = step * self.global_batch + replica * per_replica
        return list(self.rows(first, first + per_replica).split(micro_batch))


def validation_batches(
    tokens: torch.Tensor, seq_len: int, batch_size: int, num_batches: int
) -> list[torch.Tensor]:
    """The first windows of the held-out stream, in order: the same for every run."""
    n = min(num_batches * batch_size, (len(tokens) - 1) // seq_len)
    if n < batch_size:
        return []
    rows = [tokens[i * seq_len : i * seq_len + seq_len + 1] for i in range(n - n % batch_size)]
    return list(torch.stack(rows).long().split(batch_size))


def on_device(batches: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """The batches where the model computes. On CUDA they are pinned (page-locked) first,
    so the copy runs asynchronously and the host goes on queueing work."""
    if device.type != "cuda":
        return [b.to(device) for b in batches]
    return [b.pin_memory().to(device, non_blocking=True) for b in batches]


def keep_tokenizer(cfg: Any, run_dir: Path) -> None:
    """Copy the data's tokenizer into RUN_DIR/tokenizer/, where sample and eval read it."""
    source = data_tokenizer(cfg)
    if source is not None:
        (run_dir / "tokenizer").mkdir(exist_ok=True)
        shutil.copy2(source, run_dir / "tokenizer" / "tokenizer.json")
        template = Path(source).parent / KEPT  # a chat data set's template
        if template.is_file():
            shutil.copy2(template, run_dir / "tokenizer" / KEPT)
