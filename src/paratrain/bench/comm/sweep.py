"""`paratrain bench comm`'s flags made into a checked `Sweep`: ops, algorithms, world
sizes, message sizes and how many samples each gets."""

from __future__ import annotations

import re
from dataclasses import dataclass

from paratrain.bench.comm.fit import ELEMENT_BYTES
from paratrain.comm.algos import OUR_ALGOS
from paratrain.comm.all_to_all import ALGOS as ALL_TO_ALL_ALGOS
from paratrain.config import COMM_ALGOS

# Per op, the algorithms the bench can run: the run-wide ones, and all_to_all's own
# (native, and our pairwise exchange, which a call names: it is no run-wide default).
BENCH_ALGOS = {**OUR_ALGOS, "all_to_all": ALL_TO_ALL_ALGOS}
OPS = tuple(BENCH_ALGOS)  # all_reduce, reduce_scatter, all_gather, broadcast, reduce, all_to_all
ALGOS = tuple(dict.fromkeys((*COMM_ALGOS, *ALL_TO_ALL_ALGOS)))  # native, ring, tree, pairwise
DEFAULT_SIZES = tuple(1024 * 4**i for i in range(9))  # 1 KB, 4 KB, ... 64 MB
DEFAULT_SIZES_FLAG = "1KB,4KB,16KB,64KB,256KB,1MB,4MB,16MB,64MB"
DEFAULT_WORLD_SIZES = (2, 4, 8)
MAX_WORLD = 8
UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20}
UNITS |= {"mib": 2**20, "g": 2**30, "gb": 2**30, "gib": 2**30}
INNER_BYTES = 1 << 20  # a sample is at least this many message bytes, up to MAX_INNER calls
MAX_INNER = 16
BIG_BYTES = 4 << 20  # above this, fewer samples: each already takes tens of milliseconds


def parse_size(text: str) -> int:
    """'64MB' -> 67108864. Units are binary (1 KB = 1024 bytes), as in nccl-tests."""
    match = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in UNITS:
        raise ValueError(f"message size {text!r}: expected a number with B, KB, MB or GB")
    nbytes = int(match.group(1)) * UNITS[unit]
    if nbytes <= 0 or nbytes % ELEMENT_BYTES:
        raise ValueError(
            f"message size {text!r} = {nbytes} bytes must be a positive multiple of "
            f"{ELEMENT_BYTES} (the bench sends float32)"
        )
    return nbytes


def _names(text: str, valid: tuple[str, ...], what: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    for n in names:
        if n not in valid:
            raise ValueError(f"unknown {what} {n!r}; valid: {', '.join(valid)}")
    if not names:
        raise ValueError(f"--{what}s {text!r} names no {what}")
    return names


@dataclass(frozen=True)
class Sweep:
    """What to measure. Built from the flags by `Sweep.from_flags`, which checks them."""

    ops: tuple[str, ...] = OPS
    algos: tuple[str, ...] = ALGOS
    world_sizes: tuple[int, ...] = DEFAULT_WORLD_SIZES
    sizes: tuple[int, ...] = DEFAULT_SIZES
    repeats: int = 10
    timeout_s: float = 120.0  # per collective; a hang fails with the comm layer's report

    @classmethod
    def from_flags(cls, ops: str, algos: str, world_sizes: str, sizes: str, repeats: int) -> Sweep:
        try:
            worlds = tuple(int(w) for w in world_sizes.split(","))
        except ValueError:
            raise ValueError(f"--world-sizes {world_sizes!r}: expected e.g. 2,4,8") from None
        for w in worlds:
            if not 2 <= w <= MAX_WORLD:
                raise ValueError(f"world size {w} outside 2..{MAX_WORLD}")
        if repeats < 1:
            raise ValueError(f"--repeats {repeats} must be at least 1")
        sweep = cls(
            _names(ops, OPS, "op"),
            _names(algos, ALGOS, "algo"),
            worlds,
            tuple(parse_size(s) for s in sizes.split(",")),
            repeats,
        )
        if not sweep.pairs():
            raise ValueError(
                f"no op of {', '.join(sweep.ops)} has an algorithm of {', '.join(sweep.algos)}"
            )
        return sweep

    def pairs(self) -> list[tuple[str, str]]:
        """(op, algo) pairs to run: tree only where the op has it, ring and pairwise likewise."""
        return [(o, a) for o in self.ops for a in self.algos if a in BENCH_ALGOS[o]]

    def samples(self, nbytes: int, oversubscribed: bool = False) -> tuple[int, int]:
        """(samples, calls per sample): fewer of both for big messages, and fewer samples
        where ranks outnumber cores (those times are not meaningful; the bytes are)."""
        inner = max(1, min(MAX_INNER, INNER_BYTES // nbytes))
        few = oversubscribed or nbytes > BIG_BYTES
        return min(self.repeats, max(3, self.repeats // 3) if few else self.repeats), inner
