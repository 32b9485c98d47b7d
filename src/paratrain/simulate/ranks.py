"""Which ranks to simulate, and each in a process of its own.

`--ranks` is a comma-separated list of global ranks, or `roles`: one rank per kind of
rank. This first version's kinds: each pipeline stage (its layers, chunks and ends) by
the first and last tp coordinate (the vocabulary's split) and the first and last dp
coordinate (a ZeRO shard's padding sits on the last), at cp and ep coordinate 0; cp and
ep classes are not yet told apart (issue 32).
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
    return MeshShape(dp=p.dp, pp=p.pp, tp=p.tp, cp=p.cp, ep=p.ep)


def role_ranks(shape: MeshShape) -> list[int]:
    """One rank per kind this runtime distinguishes (module docstring), in rank order."""
    chosen = set()
    for stage in range(shape.pp):
        for dp in {0, shape.dp - 1}:
            for tp in {0, shape.tp - 1}:
                chosen.add(shape.rank_at({"pp": stage, "dp": dp, "cp": 0, "tp": tp}))
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
