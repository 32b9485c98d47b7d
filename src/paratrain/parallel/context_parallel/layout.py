"""Which tokens of the sequence each context-parallel rank holds, and which blocks of
causal attention it must compute: pure arithmetic, no tensors of the model, no groups.

The sequence is cut into equal chunks. Plain layout: cp chunks, rank r holds chunk r.
Load-balanced layout (Megatron-LM's context parallelism; Brandon et al., "Striped
Attention", arXiv:2311.09431, for the problem): 2·cp chunks, rank r holds chunks r and
2·cp-1-r. Under a causal mask query chunk i sees key chunk j fully when j < i, as a lower
triangle when j = i, and not at all when j > i, so in the plain layout rank r does r + 1
blocks of work and the last rank cp; balanced, every rank does 2·cp + 1 half-size blocks
(docs/context-parallel.md derives both).
"""

from __future__ import annotations

import torch


def num_chunks(cp: int, balanced: bool) -> int:
    return 2 * cp if balanced else cp


def chunks_of(rank: int, cp: int, balanced: bool) -> tuple[int, ...]:
    """The global chunk indices rank `rank` holds, in the order its local tensor has them."""
    if not 0 <= rank < cp:
        raise ValueError(f"rank {rank} outside a context-parallel group of {cp}")
    return (rank, 2 * cp - 1 - rank) if balanced else (rank,)


def chunk_length(seq_len: int, cp: int, balanced: bool) -> int:
    n = num_chunks(cp, balanced)
    if seq_len % n:
        layout = "load-balanced" if balanced else "plain"
        raise ValueError(
            f"sequence length {seq_len} is not divisible by {n}, the number of chunks of "
            f"the {layout} layout at cp={cp}"
        )
    return seq_len // n


def permutation(
    seq_len: int, cp: int, balanced: bool, device: torch.device | None = None
) -> torch.Tensor:
    """Sequence positions in rank order: rank 0's tokens, then rank 1's, and so on.

    `x.index_select(dim, permutation(...))` cut into cp equal pieces gives every rank its
    local tokens; `inverse(...)` puts the concatenated ranks' outputs back in order.
    """
    length = chunk_length(seq_len, cp, balanced)
    order = [c for r in range(cp) for c in chunks_of(r, cp, balanced)]
    return torch.cat([torch.arange(c * length, (c + 1) * length, device=device) for c in order])


def inverse(perm: torch.Tensor) -> torch.Tensor:
    """The permutation that undoes `perm`: inverse(perm)[perm[i]] = i."""
    return torch.argsort(perm)


def positions(
    seq_len: int, cp: int, rank: int, balanced: bool, device: torch.device | None = None
) -> torch.Tensor:
    """The global positions of rank `rank`'s local tokens (what rotary angles follow)."""
    return permutation(seq_len, cp, balanced, device).chunk(cp)[rank]


def shard(x: torch.Tensor, cp: int, rank: int, balanced: bool, dim: int) -> torch.Tensor:
    """This rank's local tokens of a full sequence along `dim`, in layout order (a copy of
    those alone: nothing keeps the whole sequence alive)."""
    return x.index_select(dim, positions(x.shape[dim], cp, rank, balanced, x.device))


def visibility(q_chunk: int, kv_chunk: int, causal: bool) -> str | None:
    """How query chunk i sees key chunk j: 'full', 'diagonal' (a lower triangle), or None."""
    if not causal or kv_chunk < q_chunk:
        return "full"
    return "diagonal" if kv_chunk == q_chunk else None


def visible_keys(
    q_chunk: int,
    kv_chunks: tuple[int, ...],
    causal: bool,
    length: int,
    device: torch.device | None = None,
) -> tuple[list[int], torch.Tensor | None]:
    """Which of a source rank's key chunks (local indices) query chunk `q_chunk` sees, and
    the (length, seen keys) mask to apply to their concatenation; None when all of it is
    seen. Chunks seen not at all are left out: that skipped work is what balancing evens."""
    seen = [i for i, c in enumerate(kv_chunks) if visibility(q_chunk, c, causal)]
    if not any(visibility(q_chunk, kv_chunks[i], causal) == "diagonal" for i in seen):
        return seen, None
    offsets = torch.arange(length, device=device)
    q_pos = q_chunk * length + offsets
    k_pos = torch.cat([kv_chunks[i] * length + offsets for i in seen])
    return seen, k_pos[None, :] <= q_pos[:, None]  # (length, keys)
