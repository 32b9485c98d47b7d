"""How many bytes each rank moves in each collective: the formulas the ledger records.

The backend does not report what its native collectives send, so for them the ledger
records what the standard bandwidth-optimal algorithm moves per rank: NCCL's ring
algorithms (Patarasuk & Yuan 2009; the nccl-tests "bus bandwidth" conventions). For our
own ring and tree algorithms the ledger records what was actually sent, and the tests
compare that with these formulas to the byte.

S is the size in bytes of: the tensor (all_reduce, broadcast, reduce), the full
concatenated tensor (all_gather output, reduce_scatter input, scatter input, gather
output). Chunks of a tensor that k does not divide follow `chunk_sizes`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Traffic:
    sent: int
    recv: int
    messages: int  # point-to-point messages this rank sends


def chunk_sizes(numel: int, parts: int) -> list[int]:
    """Split numel elements into `parts` chunks, the first numel % parts one larger.

    The same rule as torch.tensor_split, so chunk r of a flat tensor is what rank r owns.
    """
    base, extra = divmod(numel, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def ring_all_gather(chunk_bytes: list[int], rank: int) -> Traffic:
    """Ring all-gather: at step s rank r forwards chunk (r - s) mod k to rank r + 1.

    Over k - 1 steps it sends every chunk but chunk (r + 1) mod k, and receives every
    chunk but its own: 2 (k-1) S / k in all when k divides S.
    """
    k = len(chunk_bytes)
    if k == 1:
        return Traffic(0, 0, 0)
    total = sum(chunk_bytes)
    return Traffic(total - chunk_bytes[(rank + 1) % k], total - chunk_bytes[rank], k - 1)


def ring_reduce_scatter(chunk_bytes: list[int], rank: int) -> Traffic:
    """Ring reduce-scatter ending with rank r owning the sum of chunk r.

    At step s rank r sends its partial sum of chunk (r - s - 1) mod k and receives chunk
    (r - s - 2) mod k: over k - 1 steps it sends every chunk but its own and receives
    every chunk but (r - 1) mod k.
    """
    k = len(chunk_bytes)
    if k == 1:
        return Traffic(0, 0, 0)
    total = sum(chunk_bytes)
    return Traffic(total - chunk_bytes[rank], total - chunk_bytes[(rank - 1) % k], k - 1)


def ring_all_reduce(chunk_bytes: list[int], rank: int) -> Traffic:
    """Reduce-scatter then all-gather: 2 (k-1) S / k per rank when k divides S.

    Our ring leaves rank r owning chunk r after the reduce-scatter phase, then all-gathers.
    """
    rs, ag = ring_reduce_scatter(chunk_bytes, rank), ring_all_gather(chunk_bytes, rank)
    return Traffic(rs.sent + ag.sent, rs.recv + ag.recv, rs.messages + ag.messages)


def chain_broadcast(nbytes: int, size: int, rank: int, root: int) -> Traffic:
    """Pipelined chain root -> root+1 -> ... -> root-1: all but the last rank send S once."""
    if size == 1:
        return Traffic(0, 0, 0)
    position = (rank - root) % size
    sends = position != size - 1
    return Traffic(nbytes if sends else 0, 0 if position == 0 else nbytes, int(sends))


def chain_reduce(nbytes: int, size: int, rank: int, root: int) -> Traffic:
    """The chain reversed, root+1 -> ... -> root-1 -> root: all but the root send S once."""
    if size == 1:
        return Traffic(0, 0, 0)
    position = (rank - root) % size  # 0 is the root, 1 starts the chain
    return Traffic(
        0 if position == 0 else nbytes, 0 if position == 1 else nbytes, int(position != 0)
    )


def owner_reduces(chunk_bytes: list[int], rank: int) -> Traffic:
    """A reduce of each non-empty chunk to its rank (padded.py's uneven reduce-scatter),
    each a chain: every chunk but the rank's own sent, every chunk but its predecessor's
    received, as the ring (ring_reduce_scatter); a message per other owner."""
    k = len(chunk_bytes)
    parts = [chain_reduce(n, k, rank, owner) for owner, n in enumerate(chunk_bytes) if n]
    return Traffic(
        sum(p.sent for p in parts), sum(p.recv for p in parts), sum(p.messages for p in parts)
    )


def native_traffic(
    op: str,
    nbytes: int,
    size: int,
    rank: int = 0,
    root: int = 0,
    chunk_bytes: list[int] | None = None,
) -> Traffic:
    """Per-rank traffic of a native collective over `size` ranks (see module docstring)."""
    if size == 1 or nbytes == 0:
        return Traffic(0, 0, 0)
    chunks = chunk_bytes if chunk_bytes is not None else chunk_sizes(nbytes, size)
    if op == "all_reduce":
        return ring_all_reduce(chunks, rank)
    if op == "all_gather":
        return ring_all_gather(chunks, rank)
    if op == "reduce_scatter":
        return ring_reduce_scatter(chunks, rank)
    if op == "broadcast":
        return chain_broadcast(nbytes, size, rank, root)
    if op == "reduce":
        return chain_reduce(nbytes, size, rank, root)
    if op == "scatter":
        if rank == root:
            return Traffic(nbytes - chunks[rank], 0, size - 1)
        return Traffic(0, chunks[rank], 0)
    if op == "gather":
        if rank == root:
            return Traffic(0, nbytes - chunks[rank], 0)
        return Traffic(chunks[rank], 0, 1)
    raise ValueError(f"no traffic formula for op {op!r}")


def pairwise_all_to_all(send_bytes: list[int], recv_bytes: list[int], rank: int) -> Traffic:
    """All-to-all: rank r sends chunk p of its input to rank p and keeps chunk r.

    Whatever the algorithm, every byte meant for another rank must leave this one, so the
    direct pairwise exchange is the least any algorithm moves: every chunk but its own,
    one message per non-empty chunk; (k-1) S / k each way when S (this rank's input) is
    split evenly.
    """
    k = len(send_bytes)
    others = [p for p in range(k) if p != rank]
    return Traffic(
        sum(send_bytes[p] for p in others),
        sum(recv_bytes[p] for p in others),
        sum(1 for p in others if send_bytes[p] > 0),
    )
