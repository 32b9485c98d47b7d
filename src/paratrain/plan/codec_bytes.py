"""Bytes of float32 vectors sent in a codec (comm/codecs.py, comm/low_precision.py), for
DiLoCo's outer gradients (plan/rank_diloco.py) and --compress (plan/rank_compress.py).

A codec has a number of bits per element and, for the scaled ones, a float32 scale per
SCALE_BLOCK elements of each chunk (each rank's chunk is encoded on its own). A mean in a
codec over k ranks cuts the vector into chunks (torch's tensor_split sizes): its
reduce-scatter is an all-to-all in which a rank sends every encoded chunk but its own;
its all-gather is a ring of the encoded means, in which a rank sends every chunk but the
next rank's (comm/traffic.py `ring_all_gather`).
"""

from __future__ import annotations

from paratrain.plan import comm

# bits per element, and whether a float32 scale per block follows the codes
ENCODINGS = {"bfloat16": (16, False), "int8": (8, True), "fp4": (4, True), "sign": (1, True)}
SCALE_BLOCK = 256


def encoded_bytes(n: int, codec: str) -> int:
    """Bytes of n float32 elements in `codec`."""
    bits, scaled = ENCODINGS[codec]
    return -(-n * bits // 8) + (4 * -(-n // SCALE_BLOCK) if scaled else 0)


def codec_reduce_scatter_bytes(sizes: list[int], codec: str, rank: int) -> int:
    """What `rank` sends to reduce chunks of `sizes` (one per rank) to their owners."""
    chunks = [encoded_bytes(n, codec) for n in sizes]
    return sum(chunks) - chunks[rank]


def codec_all_reduce_bytes(elements: int, codec: str, k: int, rank: int) -> int:
    """What `rank` sends for the mean of `elements` over k ranks in `codec`: the
    reduce-scatter, then the all-gather of the encoded means."""
    sizes = comm.chunk_elements(elements, k)
    gather = [encoded_bytes(n, codec) for n in sizes]
    return codec_reduce_scatter_bytes(sizes, codec, rank) + sum(gather) - gather[(rank + 1) % k]


def decode_bytes(n: int, codec: str) -> int:
    """Decoding n elements (comm/codecs.py `decode`) at its largest. bfloat16: a copy of
    the bytes, then float32. A scaled codec: the float32 values, the zero-padded blocks,
    their product with the scales, and the scales' copy; fp4's values are made from its
    codes through int64 indices, the magnitudes and their negation (14 bytes an
    element beside the scales), more than that."""
    if codec == "bfloat16":
        return 6 * n
    blocks = -(-n // SCALE_BLOCK)
    scaled = 4 * (n + 2 * blocks * SCALE_BLOCK + blocks)
    return max(scaled, 14 * n + 4 * blocks) if codec == "fp4" else scaled


def codec_mean_peak_bytes(sizes: list[int], codec: str, gathered: bool) -> int:
    """A rank's largest moment reducing a float32 vector cut into chunks of `sizes` in
    `codec`, beyond the vector and its error, which it already holds (--compress,
    parallel/data_parallel/compression.py `_codec_mean`): decoding what it received (its
    float32 sum, the received chunks and what it sent), or for an all-reduce (`gathered`)
    decoding the gathered means into the float32 result, beside the gathered bytes and
    its own encoded mean. At the largest chunk: the rank's own may be smaller."""
    c = max(sizes)
    encoded = sum(encoded_bytes(n, codec) for n in sizes)
    if gathered:
        return 4 * sum(sizes) + encoded + encoded_bytes(c, codec) + decode_bytes(c, codec)
    return encoded + len(sizes) * encoded_bytes(c, codec) + 4 * c + decode_bytes(c, codec)
