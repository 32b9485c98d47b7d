"""Decoding from a plain model: greedy (temperature 0) or sampled with temperature and
top-k, with a KV cache (each step feeds one new token) or without (each step re-runs the
whole prefix, the reference the cache is tested against)."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from paratrain.models.kv_cache import KVCache


def next_token(
    logits: torch.Tensor,
    temperature: float,
    top_k: int,
    generator: torch.Generator | None,
    vocab: int | None = None,
) -> torch.Tensor:
    """(B, V) logits of the last position -> (B, 1) ids: argmax at temperature 0, else a
    draw from softmax(logits / temperature) over the top_k most likely (0: all). Ids from
    `vocab` on (rows padded for tensor parallelism) are never chosen."""
    if vocab is not None and vocab < logits.shape[-1]:
        padding = torch.arange(logits.shape[-1], device=logits.device) >= vocab
        logits = logits.masked_fill(padding, float("-inf"))
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    vocab: int | None = None,
) -> torch.Tensor:
    """(B, T) prompt ids -> (B, T + max_new_tokens) ids. The model must be whole (no
    pipeline split): it is called as model(ids[, cache=...]) for logits."""
    was_training = model.training
    model.eval()
    ids = prompt
    blocks = cast(nn.ModuleDict, model.blocks)  # every model of models/ keeps them so
    cache = KVCache(len(blocks)) if use_cache else None
    fresh = ids  # what the model has not seen yet
    for _ in range(max_new_tokens):
        logits = model(fresh, cache=cache) if cache is not None else model(ids)
        token = next_token(logits[:, -1], temperature, top_k, generator, vocab)  # (B, 1)
        ids = torch.cat([ids, token], dim=1)
        fresh = token
    model.train(was_training)
    return ids
