"""Rows of token ids as every engine reads them: T + 1 ids a row, the inputs [:-1] and the
targets [1:].

A token that is no loss target (a prompt, a user's turn of a conversation, padding) is
stored as its bitwise complement ~id, a negative number. A document packed behind another
in one row (--packing documents) starts with a token that carries the DOCUMENT_START bit
as well, and never a target (its prediction would read the previous document). So one
integer tensor carries the ids, the loss mask and the documents' boundaries through every
strategy and pipeline stage unchanged, and where the model is called `split_rows` reads
the ids and targets out of it, `document_positions` the positions of packed documents.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100  # the loss's ignored target (nn.CrossEntropyLoss's default)
PAD = ~0  # padding after a row's last token: id 0, no target
DOCUMENT_START = 1 << 40  # far above any vocabulary; set only on non-targets (~(id | bit))


def as_not_targets(ids: torch.Tensor) -> torch.Tensor:
    """These ids kept as inputs but out of the loss."""
    return torch.bitwise_not(ids)


def as_document_start(stored: torch.Tensor) -> torch.Tensor:
    """A stored token (id or ~id) as the first token of a packed document: not a target."""
    ids = torch.where(stored < 0, torch.bitwise_not(stored), stored)
    return torch.bitwise_not(torch.bitwise_or(ids, DOCUMENT_START))


def _raw(inputs: torch.Tensor) -> torch.Tensor:
    return torch.where(inputs < 0, torch.bitwise_not(inputs), inputs)


def split_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(b, T + 1) stored rows -> (inputs, targets), (b, T) each: the ids, and the ids that
    are loss targets with IGNORE_INDEX elsewhere."""
    inputs, targets = rows[:, :-1], rows[:, 1:]
    inputs = torch.bitwise_and(_raw(inputs), DOCUMENT_START - 1)
    return inputs, targets.masked_fill(targets < 0, IGNORE_INDEX)


def document_positions(rows: torch.Tensor) -> torch.Tensor | None:
    """(b, T) positions of the inputs within their documents, counting from 0 at each
    DOCUMENT_START (and at a row's first token); None for rows of no packed document,
    which attend causally over the whole row."""
    starts = torch.bitwise_and(_raw(rows[:, :-1]), DOCUMENT_START) != 0  # (b, T)
    if not bool(starts.any()):
        return None
    index = torch.arange(starts.shape[1], device=rows.device).expand_as(starts)
    last_start = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - last_start


def model_keywords(rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """The keyword arguments of the model's call beside (inputs, targets): `positions`
    for rows of packed documents (document-aware attention), none otherwise."""
    positions = document_positions(rows)
    return {} if positions is None else {"positions": positions}


def target_count(rows: torch.Tensor) -> int:
    """How many of the rows' tokens are loss targets."""
    return int((rows[:, 1:] >= 0).sum())
