"""`paratrain bench slow-links`: what each way of training over a slow link buys, in
validation loss after the same tokens and in bytes exchanged between the groups
(docs/diloco.md, docs/compression.md).

On `paratrain train`'s default model and data, `--groups` replica groups of one rank each
(ZeRO-1), every way trains the same steps on the same global batches, so the same tokens,
through train/loop.py's whole loop, and is evaluated on the same held-out batches at the
end: synchronous HSDP; HSDP with its all-reduce across the groups in int8 or sign with
error feedback; data parallelism with PowerSGD (one group of all ranks, no ZeRO: it needs
whole matrices); DiLoCo at two H; Streaming DiLoCo with fp4 outer gradients. The bytes
are what rank 0 sent over the whole run (set-up included) in the group that crosses
between the groups (dp_replicate; dp for PowerSGD). No time is measured: the link bench
(`paratrain bench diloco`) is the one for that.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from paratrain.config import RunConfig
from paratrain.data.tokens import TokenData, load_tokens
from paratrain.spawn import run_ranks
from paratrain.validate import resolve_and_check

log = logging.getLogger(__name__)


def ways(short: int, long: int, rank: int) -> dict[str, dict[str, Any]]:
    """name: the parallel settings on top of HSDP's groups of one rank (H: short, long)."""
    return {
        "dp (HSDP)": {},
        "dp int8": {"compress": "int8"},
        "dp sign": {"compress": "sign"},
        f"dp powersgd r{rank}": {
            "compress": "powersgd", "compress_rank": rank, "replicas": 1, "zero": 0,
        },
        f"diloco H{short}": {"dp_mode": "diloco", "sync_every": short},
        f"diloco H{long}": {"dp_mode": "diloco", "sync_every": long},
        f"streaming fp4 H{short}": {
            "dp_mode": "diloco", "sync_every": short, "fragments": 2, "outer_dtype": "fp4",
        },
    }  # fmt: skip


def _train_one(rank: int, world: int, cfg: RunConfig, data: TokenData) -> dict:
    from paratrain.comm import Ledger
    from paratrain.mesh import Mesh
    from paratrain.train.loop import train

    ledger = Ledger()
    replicas = cfg.parallel.replicas
    mesh = Mesh.build(dp=world, replicas=replicas, ledger=ledger)
    result = train(cfg, mesh, data)
    mesh.close()
    across = "dp_replicate" if replicas > 1 else "dp"
    last = result.metrics[-1]
    return {"sent": ledger.bytes_sent(group=across), "loss": last.loss, "val": result.val_loss}


def run_slow_links_bench(
    groups: int = 2,
    steps: int = 300,
    short: int = 20,
    long: int = 100,
    rank: int = 4,
    base: RunConfig | None = None,
    data: TokenData | None = None,
) -> dict[str, Any]:
    """`base`: the model and batch (default: `paratrain train`'s); `data`: the tokens
    (default: the embedded default data)."""
    base = copy.deepcopy(base or RunConfig())
    p, t = base.parallel, base.train
    valid = [g for g in range(2, t.global_batch + 1) if t.global_batch % g == 0]
    if groups not in valid:
        raise ValueError(
            f"--groups {groups}: each group takes an equal share of the {t.global_batch} "
            f"sequences of a step; valid: {', '.join(map(str, valid))}"
        )
    t.micro_batch = min(t.micro_batch, t.global_batch // groups)
    data = data or load_tokens("")
    p.nproc, p.dp, p.replicas, p.zero = groups, groups, groups, 1
    t.steps, t.checkpoint_every = steps, 0
    configs = {}  # every way checked before any runs
    for name, settings in ways(short, long, rank).items():
        cfg = copy.deepcopy(base)
        for key, value in settings.items():
            setattr(cfg.parallel, key, value)
        configs[name] = resolve_and_check(cfg, groups)
    out: dict[str, Any] = {"groups": groups, "steps": steps, "ways": {}}
    for name, cfg in configs.items():
        ranks = run_ranks(_train_one, groups, cfg, data)
        out["ways"][name] = ranks[0]
        log.info(
            "%s: validation loss %.4f (training %.4f), %.3f MB sent across by rank 0",
            name, ranks[0]["val"], ranks[0]["loss"], ranks[0]["sent"] / 1e6,
        )  # fmt: skip
    return out
