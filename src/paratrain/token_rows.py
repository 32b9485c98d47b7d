"""Rows of token ids as every engine reads them: T + 1 ids a row, the inputs [:-1] and the
targets [1:].

A token that is no loss target (a prompt, a user's turn of a conversation, padding) is
stored as its bitwise complement ~id, a negative number. So one integer tensor carries the
ids and the loss mask through every strategy, pipeline stage and context shard unchanged,
and `split_rows`, where the model is called, reads both out of it.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100  # the loss's ignored target (nn.CrossEntropyLoss's default)
PAD = ~0  # padding after a row's last token: id 0, no target


def as_not_targets(ids: torch.Tensor) -> torch.Tensor:
    """These ids kept as inputs but out of the loss."""
    return torch.bitwise_not(ids)


def split_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(b, T + 1) stored rows -> (inputs, targets), (b, T) each: the ids, and the ids that
    are loss targets with IGNORE_INDEX elsewhere."""
    inputs, targets = rows[:, :-1], rows[:, 1:]
    inputs = torch.where(inputs < 0, torch.bitwise_not(inputs), inputs)
    return inputs, targets.masked_fill(targets < 0, IGNORE_INDEX)


def target_count(rows: torch.Tensor) -> int:
    """How many of the rows' tokens are loss targets."""
    return int((rows[:, 1:] >= 0).sum())
