"""What `paratrain bench comm` measured on the wire, beside the ledger's bytes.

The ledger counts our ring and tree by the bytes passed to `isend`, and native collectives
by the bandwidth-optimal formula (docs/comm.md). The wire (measure/tcp_bytes.py: the kernel's
tcpi_bytes_acked of every TCP socket of the rank, the store's excluded) shows what gloo
really sent. Measured here with gloo over loopback (torch 2.13, 2 to 4 ranks), per rank,
for a message of S bytes on k ranks:

    all_reduce       2(k-1)/k S      a ring: the formula
    all_gather       (k-1)/k S       a ring: the formula
    reduce_scatter   2(k-1)/k S      twice the formula: gloo all-reduces the whole tensor
                                     and keeps this rank's chunk
    broadcast        S per child     a binomial tree: rank r sends to r + 2^j for every
                                     2^j > r below k (root 0: ceil(log2 k) children); the
                                     chain formula has every rank but the last send S once.
                                     Same total (k-1) S, other ranks
    reduce           not modelled    2 ranks: root S/2, the other S (a reduce-scatter, then
                                     the other chunk to the root); more ranks: about
                                     0.83 S at the root, 1.08 to 1.17 S elsewhere
    send, recv       S
    all_to_all       (k-1)/k S       pairwise exchange: the formula (2 and 4 ranks)

On top of that, gloo's TCP transport puts a 48-byte preamble (six 64-bit fields: length,
opcode, slot, offsets) before every message and sends a bare preamble to announce each
posted receive: a 2-rank all-reduce of any size carries 12 of them, 576 bytes; a
broadcast's receiver sends one, 48 bytes. tcpi_bytes_acked counts TCP payload only: the
TCP/IP headers (52 bytes a segment, IPv4 with timestamps; loopback segments are up to
64 KB) are estimated from tcpi_data_segs_out and reported apart.
"""

from __future__ import annotations

from paratrain.bench.comm.fit import expected_sent

PREAMBLE = 48  # gloo/transport/tcp: the Op preamble before every message
SLACK_PER_CALL = 4096  # the most preamble bytes one call may add per rank (576 observed)
# gloo cuts a large message into pieces of its own, each with a preamble: a 2-rank native
# all-reduce added 576, 2,304 and 9,216 bytes at 4, 16 and 64 MB (one piece per 341 KiB).
# The slack grows with the payload at one preamble per 256 KiB, above what was seen.
SLACK_PIECE = 256 * 1024


def slack(nbytes: int) -> int:
    """The most overhead a call of `nbytes` may add per rank and still match the model."""
    return SLACK_PER_CALL + PREAMBLE * -(-nbytes // SLACK_PIECE)


def binomial_children(rank: int, k: int) -> int:
    """Children of `rank` in the binomial broadcast tree rooted at 0 (gloo's broadcast)."""
    return sum(1 for j in range(k.bit_length()) if 2**j > rank and rank + 2**j < k)


def gloo_model(op: str, algo: str, nbytes: int, k: int) -> list[int] | None:
    """Payload bytes each rank sends for one call, as gloo does it (module docstring);
    None where no model is claimed (gloo's reduce)."""
    formula = expected_sent(op, algo, nbytes, k)
    if algo != "native":  # our ring and tree: the ledger counts the bytes really passed
        return formula
    if op == "reduce_scatter":
        return expected_sent("all_reduce", "native", nbytes, k)
    if op == "broadcast":
        return [nbytes * binomial_children(r, k) for r in range(k)]
    if op == "reduce":
        return None
    return formula


def why(op: str, algo: str) -> str:
    """One line: where the wire differs from the ledger, and why."""
    if algo != "native":
        return "ledger counts what was sent; + preambles"
    return {
        "all_reduce": "gloo's ring = the formula; + preambles",
        "all_gather": "gloo's ring = the formula; + preambles",
        "reduce_scatter": "gloo all-reduces, keeps a chunk: 2x the formula; + preambles",
        "broadcast": "gloo's binomial tree, the ledger a chain; + preambles",
        "reduce": "gloo's own reduce-scatter and gather; not modelled",
        "all_to_all": "gloo's pairwise exchange = the formula; + preambles",
    }[op]


def compare(op: str, algo: str, nbytes: int, k: int, wire: list[int]) -> dict:
    """The wire beside gloo's model: overhead per rank and whether it is within the slack."""
    model = gloo_model(op, algo, nbytes, k)
    over = None if model is None else [w - m for w, m in zip(wire, model, strict=True)]
    return {
        "wire_model_bytes_per_rank": model,
        "wire_overhead_bytes_per_rank": over,
        # below the model means bytes went missing: the measurement, not gloo, is wrong
        "wire_match": over is None or all(0 <= o <= slack(nbytes) for o in over),
        "wire_note": why(op, algo),
    }
