"""Rows of whole documents (a prepared data set's), for `--packing none` and `documents`.

- none: one document a row. Each row is the document's first seq_len + 1 tokens, padded
  after its end with token_rows.PAD (token 0, no loss target), so no token sees another
  document and positions start at 0 in every row.
- documents: consecutive documents, in the data's order, packed whole into rows of
  seq_len + 1 while they fit; each packed document's first token carries
  token_rows.DOCUMENT_START (and is no target), so that attention stays within each
  document and positions restart (token_rows.document_positions). Little is padded.

A document longer than the row is cut there, in both. The order is BatchSampler's: a
permutation of the rows drawn from (seed, epoch), the global batch of step s the next G
of it, so it depends only on (seed, step).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from paratrain.data.tokens import BatchSampler, TokenData, validation_batches
from paratrain.token_rows import PAD, as_document_start


def document_row(tokens: Any, start: int, length: int, seq_len: int) -> torch.Tensor:
    """One document's row of seq_len + 1 stored ids (int64, host-side)."""
    row = torch.full((seq_len + 1,), PAD, dtype=torch.long, device="cpu")
    n = min(length, seq_len + 1)
    row[:n] = tokens[start : start + n]
    return row


def starts_of(lengths: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)


class DocumentRows(BatchSampler):
    """BatchSampler over documents instead of windows: `global_batch(step)` depends only
    on (seed, step)."""

    def __init__(
        self, tokens: Any, lengths: np.ndarray, seq_len: int, global_batch: int, seed: int
    ) -> None:
        self.tokens, self.seq_len, self.global_batch, self.seed = (
            tokens,
            seq_len,
            global_batch,
            seed,
        )
        self.lengths, self.starts = lengths, starts_of(lengths)
        self.num_windows = len(lengths)
        if self.num_windows < 1:
            raise ValueError("the data holds no document to train on")
        self._epoch_order: tuple[int, torch.Tensor] | None = None

    def row(self, window: int) -> torch.Tensor:
        start, length = int(self.starts[window]), int(self.lengths[window])
        return document_row(self.tokens, start, length, self.seq_len)


def pack(lengths: np.ndarray, row_len: int) -> np.ndarray:
    """Greedy, in order: (rows + 1,) indices, row r holding documents bounds[r] to
    bounds[r + 1] - 1, each row's lengths summing to at most row_len (a longer document
    alone, cut)."""
    bounds, used = [0], 0
    for i, length in enumerate(lengths.tolist()):
        if used and used + length > row_len:
            bounds.append(i)
            used = 0
        used += length
    bounds.append(len(lengths))
    return np.array(bounds, dtype=np.int64)


def packed_row(tokens: Any, starts: np.ndarray, lengths: np.ndarray, seq_len: int) -> torch.Tensor:
    """One row of seq_len + 1 stored ids: the documents one after another, each opened by
    DOCUMENT_START, padded after the last (int64, host-side)."""
    row = torch.full((seq_len + 1,), PAD, dtype=torch.long, device="cpu")
    at = 0
    for start, length in zip(starts.tolist(), lengths.tolist(), strict=True):
        n = min(length, seq_len + 1 - at)
        row[at : at + n] = tokens[start : start + n]
        row[at] = as_document_start(row[at])
        at += n
    return row


class PackedRows(DocumentRows):
    """DocumentRows whose windows are rows of packed documents (`pack`)."""

    def __init__(
        self, tokens: Any, lengths: np.ndarray, seq_len: int, global_batch: int, seed: int
    ) -> None:
        super().__init__(tokens, lengths, seq_len, global_batch, seed)
        self.bounds = pack(lengths, seq_len + 1)
        self.num_windows = len(self.bounds) - 1

    def row(self, window: int) -> torch.Tensor:
        docs = slice(int(self.bounds[window]), int(self.bounds[window + 1]))
        return packed_row(self.tokens, self.starts[docs], self.lengths[docs], self.seq_len)


def first_document_rows(tokens: Any, lengths: np.ndarray, seq_len: int, n: int) -> torch.Tensor:
    """The first n >= 1 documents, in order, one a row: (n, seq_len + 1)."""
    starts = starts_of(lengths)
    rows = [document_row(tokens, int(starts[i]), int(lengths[i]), seq_len) for i in range(n)]
    return torch.stack(rows)


def first_rows(
    tokens: Any, lengths: np.ndarray, seq_len: int, layout: str, n: int | None = None
) -> torch.Tensor:
    """The first n rows (default: all) of the documents, in order, cut as `layout` cuts
    them (`none` or `documents`): (rows, seq_len + 1)."""
    if layout == "none":
        return first_document_rows(tokens, lengths, seq_len, min(n or len(lengths), len(lengths)))
    packed = PackedRows(tokens, lengths, seq_len, 1, 0)
    count = min(n or packed.num_windows, packed.num_windows)
    return torch.stack([packed.row(r) for r in range(count)])


def training_rows(
    data: TokenData, layout: str, seq_len: int, global_batch: int, seed: int
) -> BatchSampler:
    """The batch sampler of a row layout (supervised.row_layout)."""
    if layout == "stream":
        return BatchSampler(data.train, seq_len, global_batch, seed)
    if data.documents is None:
        raise ValueError(f"--packing {layout} needs a data set from `paratrain prepare`")
    rows = PackedRows if layout == "documents" else DocumentRows
    return rows(data.train, data.documents["train"], seq_len, global_batch, seed)


def validation_rows(
    data: TokenData, layout: str, seq_len: int, batch_size: int, num_batches: int
) -> list[torch.Tensor]:
    """The held-out batches, the first rows of the held-out split cut as the training
    rows are."""
    if layout == "stream" or data.documents is None:
        return validation_batches(data.val, seq_len, batch_size, num_batches)
    if not len(data.documents["val"]) or num_batches < 1:
        return []
    rows = first_rows(data.val, data.documents["val"], seq_len, layout, num_batches * batch_size)
    n = len(rows) - len(rows) % batch_size
    return list(rows[:n].split(batch_size)) if n else []
