"""Which ranks to simulate, and each in a process of its own.

`--ranks` is a comma-separated list of global ranks, or `roles`: one rank per kind of
rank (roles.py).
"""

from __future__ import annotations

from concurrent.futures import ProcessPoolExecutor
from typing import Any

from paratrain.config import RunConfig
from paratrain.simulate.rank import simulate_rank_on_host
from paratrain.simulate.roles import mesh_shape, roles
from paratrain.spawn import forkserver_context


def parse_ranks(text: str, cfg: RunConfig) -> list[int]:
    """--ranks: "roles", or global ranks separated by commas, each inside the world."""
    if text == "roles":
        return roles(cfg)
    shape = mesh_shape(cfg)
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
