"""`--packing none`: one document a row. Each row is the document's first seq_len + 1
tokens, padded after its end with token_rows.PAD (token 0, no loss target), so no token
sees another document and positions start at 0 in every row. A document longer than the
row is cut there.

The order is BatchSampler's: a permutation of the documents drawn from (seed, epoch),
the global batch of step s the next G of it, so it depends only on (seed, step).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from paratrain.data.supervised import one_example_a_row
from paratrain.data.tokens import BatchSampler, TokenData, validation_batches
from paratrain.token_rows import PAD


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


def first_document_rows(tokens: Any, lengths: np.ndarray, seq_len: int, n: int) -> torch.Tensor:
    """The first n >= 1 documents, in order, one a row: (n, seq_len + 1)."""
    starts = starts_of(lengths)
    rows = [document_row(tokens, int(starts[i]), int(lengths[i]), seq_len) for i in range(n)]
    return torch.stack(rows)


def document_validation_batches(
    tokens: Any, lengths: np.ndarray, seq_len: int, batch_size: int, num_batches: int
) -> list[torch.Tensor]:
    """The first documents of the held-out split, in order, one a row."""
    n = min(num_batches * batch_size, len(lengths))
    n -= n % batch_size
    return list(first_document_rows(tokens, lengths, seq_len, n).split(batch_size)) if n else []


def one_document_a_row(data: TokenData, packing: str) -> bool:
    return one_example_a_row(packing, data.supervised)


def training_rows(
    data: TokenData, packing: str, seq_len: int, global_batch: int, seed: int
) -> BatchSampler:
    """The batch sampler --packing asks for."""
    if not one_document_a_row(data, packing):
        return BatchSampler(data.train, seq_len, global_batch, seed)
    if data.documents is None:
        raise ValueError("--packing none needs a data set from `paratrain prepare`")
    return DocumentRows(data.train, data.documents["train"], seq_len, global_batch, seed)


def validation_rows(
    data: TokenData, packing: str, seq_len: int, batch_size: int, num_batches: int
) -> list[torch.Tensor]:
    """The held-out batches, cut as the training rows are."""
    if not one_document_a_row(data, packing) or data.documents is None:
        return validation_batches(data.val, seq_len, batch_size, num_batches)
    lengths = data.documents["val"]
    return document_validation_batches(data.val, lengths, seq_len, batch_size, num_batches)
