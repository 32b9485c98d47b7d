"""Cost models of the collectives `paratrain bench comm` measures, and the alpha-beta fit.

The alpha-beta (Hockney) model prices a message of n bytes at alpha + n * beta: alpha the
latency of one message, 1 / beta the bandwidth. An algorithm of `steps` sequential rounds
that moves `factor * S` bytes along its critical path then takes

    T(k, S) = steps(k) * alpha + factor(k) * S * beta

with, for k ranks and L = ceil(log2 k) (Thakur, Rabenseifner & Gropp 2005, "Optimization
of Collective Communication Operations in MPICH", IJHPCA 19(1), section 4; ring
all-reduce: Patarasuk & Yuan 2009):

    ring all-reduce             2 (k-1) steps of S/k    T = 2(k-1) a + 2 (k-1)/k S b
    ring reduce-scatter/gather  (k-1) steps of S/k      T = (k-1) a + (k-1)/k S b
    tree all-reduce             2 L steps of S          T = 2 L a + 2 L S b
    tree broadcast / reduce     L steps of S            T = L a + L S b
    native broadcast / reduce   pipelined chain         T = (k-1) a + S b
    all-to-all (pairwise)       (k-1) steps of S/k      T = (k-1) a + (k-1)/k S b

Native collectives are modelled by the algorithm the ledger counts them with (ring, chain;
all-to-all: the pairwise exchange, k - 1 rounds in which each rank sends one chunk and
receives one, Thakur et al. section 4.4).
The reduction arithmetic (gamma in Thakur et al.) is folded into beta: on CPUs it is not
negligible next to the copy, and a two-parameter fit is what the issue asks for.

Bus bandwidth follows the nccl-tests conventions (nccl-tests doc/PERFORMANCE.md): algbw =
S / t, busbw = algbw * 2(k-1)/k for all-reduce, (k-1)/k for all-gather and reduce-scatter,
1 for broadcast and reduce, so that busbw is comparable with the link's bandwidth.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from paratrain.comm.traffic import (
    chunk_sizes,
    native_traffic,
    pairwise_all_to_all,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
)
from paratrain.comm.tree import tree_traffic

ELEMENT_BYTES = 4  # the bench sends float32


@dataclass(frozen=True)
class Cost:
    steps: int  # sequential message rounds: latency terms
    factor: float  # bytes on the critical path per byte of message


def _log2_ceil(k: int) -> int:
    return max(1, math.ceil(math.log2(k))) if k > 1 else 0


def cost(op: str, algo: str, k: int) -> Cost:
    """The alpha-beta cost model of (op, algo) on k ranks; see the module docstring."""
    if algo == "tree":
        rounds = _log2_ceil(k)
        return Cost(2 * rounds, 2.0 * rounds) if op == "all_reduce" else Cost(rounds, rounds)
    if op == "all_reduce":
        return Cost(2 * (k - 1), 2 * (k - 1) / k)
    if op in ("reduce_scatter", "all_gather", "all_to_all"):
        return Cost(k - 1, (k - 1) / k)
    if op in ("broadcast", "reduce"):
        return Cost(k - 1, 1.0)
    raise ValueError(f"no cost model for {op!r} with {algo!r}")


def busbw_factor(op: str, k: int) -> float:
    """nccl-tests' bus bandwidth factor: busbw = algbw * factor."""
    if op == "all_reduce":
        return 2 * (k - 1) / k
    if op in ("reduce_scatter", "all_gather", "all_to_all"):
        return (k - 1) / k
    return 1.0


def expected_sent(op: str, algo: str, nbytes: int, k: int) -> list[int]:
    """Bytes each rank must send, by rank, from `paratrain.comm.traffic` (root is rank 0).

    Chunks are cut as the comm layer cuts them (`chunk_sizes` of the float32 elements),
    and all-gather contributions follow the same cut, so the formula holds to the byte.
    """
    chunks = [ELEMENT_BYTES * n for n in chunk_sizes(nbytes // ELEMENT_BYTES, k)]
    if op == "all_to_all":  # native or pairwise: every chunk but the rank's own leaves
        return [pairwise_all_to_all(chunks, [chunks[r]] * k, r).sent for r in range(k)]
    if algo == "native":
        return [native_traffic(op, nbytes, k, r, 0, chunk_bytes=chunks).sent for r in range(k)]
    if algo == "tree":
        up, down = op in ("all_reduce", "reduce"), op in ("all_reduce", "broadcast")
        return [tree_traffic(nbytes, k, r, reduce=up, broadcast=down).sent for r in range(k)]
    formula = {
        "all_reduce": ring_all_reduce,
        "reduce_scatter": ring_reduce_scatter,
        "all_gather": ring_all_gather,
    }[op]
    return [formula(chunks, r).sent for r in range(k)]


@dataclass(frozen=True)
class Fit:
    """alpha (s per message) and beta (s per byte) of one (op, algo), fitted to its times."""

    op: str
    algo: str
    alpha_s: float
    beta_s_per_byte: float
    points: int
    world_sizes: tuple[int, ...]
    oversubscribed: bool  # fitted to times taken with more ranks than cores
    rel_rms: float  # root-mean-square relative error of the fit on its points

    def predict(self, k: int, nbytes: float) -> float:
        c = cost(self.op, self.algo, k)
        return c.steps * self.alpha_s + c.factor * nbytes * self.beta_s_per_byte

    def as_dict(self) -> dict:
        out = asdict(self)
        out["bandwidth_gbps"] = 1e-9 / self.beta_s_per_byte if self.beta_s_per_byte > 0 else None
        return out


def fit_alpha_beta(
    op: str, algo: str, points: list[tuple[int, int, float]], oversubscribed: bool
) -> Fit:
    """Least squares on (world_size, bytes, seconds) points, in relative error.

    Times span five orders of magnitude from 1 KB to 64 MB; absolute least squares would
    fit only the largest messages, so each equation is divided by its measured time.
    alpha and beta are kept non-negative (a negative one drops out and the other is refit).
    """
    import numpy as np  # here: the CLI imports this module to build its parser

    rows = [(cost(op, algo, k), n, t) for k, n, t in points]
    a = np.array([[c.steps / t, c.factor * n / t] for c, n, t in rows])
    ones = np.ones(len(rows))
    coef = np.linalg.lstsq(a, ones, rcond=None)[0]
    if coef[0] < 0 or coef[1] < 0:
        keep = 1 if coef[0] < 0 else 0
        single = np.linalg.lstsq(a[:, [keep]], ones, rcond=None)[0][0]
        coef = np.zeros(2)
        coef[keep] = max(single, 0.0)
    residual = a @ coef - ones
    return Fit(
        op,
        algo,
        float(coef[0]),
        float(coef[1]),
        len(rows),
        tuple(sorted({k for k, _, _ in points})),
        oversubscribed,
        float(np.sqrt(np.mean(residual**2))),
    )


def tree_vs_ring(ring: Fit, tree: Fit, k: int) -> dict:
    """Where the fits predict the tree all-reduce beats the ring on k ranks.

    T_tree - T_ring = d_latency + S * d_bytes: with fewer latency terms (d_latency < 0) and
    more bytes per step (d_bytes > 0), the tree wins below S* = -d_latency / d_bytes.
    """
    ct, cr = cost("all_reduce", "tree", k), cost("all_reduce", "ring", k)
    d_latency = ct.steps * tree.alpha_s - cr.steps * ring.alpha_s
    d_bytes = ct.factor * tree.beta_s_per_byte - cr.factor * ring.beta_s_per_byte
    verdict, crossover = _compare(d_latency, d_bytes)
    return {
        "world_size": k,
        "tree_faster": verdict,  # below or above crossover_bytes, always, never
        "crossover_bytes": crossover,
        "ring_steps": cr.steps,
        "tree_steps": ct.steps,
    }


def _compare(d_latency: float, d_bytes: float) -> tuple[str, float | None]:
    if d_bytes > 0:
        s = -d_latency / d_bytes
        return ("below", s) if s > 0 else ("never", None)
    if d_bytes < 0:
        s = d_latency / -d_bytes
        return ("above", s) if s > 0 else ("always", None)
    return ("always", None) if d_latency < 0 else ("never", None)


def shared_fit(fit: Fit, algo: str) -> Fit:
    """The same alpha and beta under another algorithm's cost model: the textbook comparison."""
    return Fit("all_reduce", algo, fit.alpha_s, fit.beta_s_per_byte, 0, (), False, 0.0)


PREDICT_WORLD_SIZES = (2, 4, 8, 16, 32, 64, 128, 256, 1024)


def predictions(fits: list[Fit]) -> dict[str, list[dict]]:
    """Tree against ring all-reduce from the fits: each with its own alpha and beta, and
    with the ring's for both (so only the step counts and bytes differ)."""
    by = {(f.op, f.algo): f for f in fits}
    ring, tree = by.get(("all_reduce", "ring")), by.get(("all_reduce", "tree"))
    if ring is None or tree is None:
        return {}
    return {
        "own_fits": [tree_vs_ring(ring, tree, k) for k in PREDICT_WORLD_SIZES],
        "ring_alpha_beta_for_both": [
            tree_vs_ring(ring, shared_fit(ring, "tree"), k) for k in PREDICT_WORLD_SIZES
        ],
    }
