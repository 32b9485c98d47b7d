"""Rules on the rank grid and the batch: the degrees multiply to the world size, the
global batch splits into whole micro-batches per replica, a straggler names a rank."""

from __future__ import annotations

import math

from paratrain.config import RunConfig, parse_straggler
from paratrain.config.resolution import replicas
from paratrain.validate.batch_messages import indivisible_batch


def mesh_rules(cfg: RunConfig, world_size: int) -> None:
    p = cfg.parallel
    # The other axes' degrees as the messages name them (cp only when it is on).
    axes = {"pp": p.pp, **({"cp": p.cp} if p.cp != 1 else {}), "tp": p.tp}
    names, values = " * ".join(axes), " * ".join(map(str, axes.values()))
    others = math.prod(axes.values())
    if p.dp == 0:  # resolve fills dp = 0 only where the others divide the world size
        raise ValueError(
            f"world size {world_size} is not divisible by {names} = {values}; "
            "choose degrees whose product divides the number of processes"
        )
    if p.dp * others != world_size:
        raise ValueError(
            f"dp * {names} = {p.dp} * {values} = {p.dp * others} but the world size "
            f"is {world_size}; choose degrees whose product is {world_size}"
        )


def straggler_rules(cfg: RunConfig) -> None:
    if cfg.parallel.straggler:
        parse_straggler(cfg.parallel.straggler, cfg.world_size)


def batch_rules(cfg: RunConfig) -> None:
    """G sequences per step, b per micro-batch, K = G / (b * dp) micro-batches per replica."""
    t, p = cfg.train, cfg.parallel
    if p.dp_mode == "async" and (p.dp < 2 or p.pp * p.tp != 1):
        raise ValueError(
            f"--dp-mode async needs pp = tp = 1 and dp >= 2 (one server, at least one "
            f"worker); got dp={p.dp} pp={p.pp} tp={p.tp}"
        )
    dp = replicas(p)  # async: rank 0 serves parameters; the other ranks are the replicas
    per_pass = t.micro_batch * dp
    if t.global_batch == 0:
        raise ValueError("give --global-batch G or --microbatches K (both are 0)")
    if t.global_batch % per_pass != 0:
        raise ValueError(indivisible_batch(t.global_batch, t.micro_batch, dp))
    k = t.global_batch // per_pass
    if t.microbatches != k:
        raise ValueError(
            f"--microbatches {t.microbatches} disagrees with --global-batch {t.global_batch}: "
            f"G / (b * dp) = {t.global_batch} / ({t.micro_batch} * {dp}) = {k}"
        )
