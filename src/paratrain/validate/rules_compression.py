"""Rules on --compress (parallel/data_parallel/compression.py): the reductions it can
compress, and what it does not combine with yet."""

from __future__ import annotations

from paratrain.config import RunConfig


def compression_rules(cfg: RunConfig) -> None:
    p = cfg.parallel
    if p.compress == "none":
        return
    if p.zero == 3:  # its gradients leave per unit, reduce-scattered from backward
        raise ValueError(
            f"--compress {p.compress} with --zero 3: FSDP frees each unit's whole gradient as "
            "it reduces it, and error feedback keeps one per rank; valid with --zero 0, 1 or 2"
        )
    if p.compress == "powersgd" and p.replicas > 1:
        raise ValueError(
            f"--compress powersgd with --replicas {p.replicas}: across the groups HSDP "
            "reduces flat shards, not whole matrices; use --compress int8 or sign"
        )
    if cfg.train.dtype == "float16":  # the errors would hold gradients at a stale scale
        raise ValueError(
            f"--compress {p.compress} with --dtype float16: the loss scale's changes and the "
            "steps it skips would corrupt the error buffers; use --dtype bfloat16 or float32"
        )
    if p.fault_tolerance:  # its reduction across the groups is the quorum's own
        raise ValueError(
            f"--compress {p.compress} with --fault-tolerance is not supported yet; "
            "use no --fault-tolerance"
        )
