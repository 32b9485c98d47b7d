"""Which ranks to simulate, and each in a process of its own.

`--ranks` is a comma-separated list of global ranks, or `roles`: one rank per kind of
rank. This version's kinds: each pipeline stage (its layers, chunks and ends) by the
first and last tp coordinate (the vocabulary's split) and by the first and last rank of
the dp_cp group (mesh_shape.py), that is dp and cp both first or both last. The last
holds the padded end of every shard: ZeRO's over dp_cp, or over a replica group, and the
experts' over expert_dp. Since ep runs are consecutive in dp_cp, the first and last are
also the first and last position in an ep run. The cp coordinates in between hold
load-balanced chunks of the same size: not a kind of their own (issue 32).
"""

from __future__ import annotations

from concurrent.futures import ProcessPoolExecutor
from typing import Any

from paratrain.config import RunConfig
from paratrain.mesh import MeshShape
from paratrain.simulate.rank import simulate_rank_on_host
from paratrain.spawn import forkserver_context


def mesh_shape(cfg: RunConfig) -> MeshShape:
    p = cfg.parallel
    return MeshShape(dp=p.dp, pp=p.pp, tp=p.tp, cp=p.cp, ep=p.ep, replicas=p.replicas)


def role_ranks(shape: MeshShape) -> list[int]:
    """One rank per kind this runtime distinguishes (module docstring), in rank order."""
    chosen = set()
    for stage in range(shape.pp):
        for dp, cp in {(0, 0), (shape.dp - 1, shape.cp - 1)}:  # dp_cp's first and last
            for tp in {0, shape.tp - 1}:
                chosen.add(shape.rank_at({"pp": stage, "dp": dp, "cp": cp, "tp": tp}))
    return sorted(chosen)


def parse_ranks(text: str, shape: MeshShape) -> list[int]:
    """--ranks: "roles", or global ranks separated by commas, each inside the world."""
    if text == "roles":
        return role_ranks(shape)
    try:
        ranks = [int(r) for r in text.split(",")]
    except ValueError:
        raise ValueError(f"--ranks {text!r}: give 'roles' or ranks like 0,7,63") from None
    outside = [r for r in ranks if not 0 <= r < shape.world_size]
    if outside:
        raise ValueError(
            f"--ranks {text!r}: rank {outside[0]} is outside the world of "
            f"{shape.world_size} ({shape.describe()})"
        )
    return sorted(set(ranks))


def simulate_ranks(cfg: RunConfig, ranks: list[int]) -> list[tuple[dict[str, Any], dict]]:
    """Each rank in a fresh process, one at a time (a process joins one fake world, and a
    rank of a large model needs the machine's memory to itself): (its measurement, its
    cost on this machine), in the order of `ranks`. Each is forked from a server that has
    torch imported, never from this process (its fake world would come along)."""
    results = []
    for rank in ranks:
        with ProcessPoolExecutor(max_workers=1, mp_context=forkserver_context()) as pool:
            results.append(pool.submit(simulate_rank_on_host, cfg, rank).result())
    return results
