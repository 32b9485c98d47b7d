"""HSDP (--replicas R): ZeRO within each of R replica groups, the reduced shards all-reduced
across them, trains like plain single-process PyTorch (float32).

Exact here: the data each step sees and the initial weights. Equal to float32 rounding
(tests/equivalence.py's measured Tolerance): the gradient is summed in another order
(a reduce-scatter over the replica group, then an all-reduce across the groups), and the
global norm is a float64 sum of the shards' squares over one replica group only (the
other groups hold the same shards: counting them too would report sqrt(R) times the
norm, which the per-step norm comparison catches). Skipping the cross-replica all-reduce
leaves each group with its own half of the batch's gradient, which the losses, norms and
parameters all catch.

Every run goes through `paratrain.train.loop.train` (what `paratrain train` runs) under
NCCL's ordering rules (tests/distributed.py), several layouts per set of processes.
"""

from __future__ import annotations

import pytest

from paratrain.validate import resolve_and_check
from tests.equivalence import check_layouts, tiny_config

CLIP = 0.5  # below the observed norms (about 1 to 3): clipping by the global norm is active


def hsdp_config(world, zero, replicas=2, micro_batch=2, dp=0, pp=1, tp=1, **parallel):
    cfg = tiny_config(micro_batch=micro_batch, grad_clip=CLIP)
    p = cfg.parallel
    p.nproc, p.dp, p.pp, p.tp, p.zero, p.replicas = world, dp, pp, tp, zero, replicas
    for key, value in parallel.items():
        setattr(p, key, value)
    cfg.train.microbatches = 0
    return resolve_and_check(cfg, world)


@pytest.mark.equivalence
def test_hsdp_zero_stages_match_single_process():
    """dp 4 = 2 replica groups x 2 shards: ZeRO-1, 2 (both accumulations) and 3, with one
    micro-batch per step and with two."""
    configs = [
        hsdp_config(4, zero, micro_batch=micro, bucket_mb=0.01)
        for zero in (1, 2, 3)
        for micro in (2, 1)  # K = 1, then K = 2 (G 8 over dp 4)
    ]
    configs.append(hsdp_config(4, 2, micro_batch=1, zero2_accumulate="full"))
    check_layouts(4, configs, CLIP)


def test_hsdp_composes_with_tensor_and_pipeline_parallelism():
    """dp 2 = 2 replica groups of one rank (shards of the whole) beside tp 2 or pp 2, and
    dp 4 = 4 replica groups (every rank its own group: all-reduce only)."""
    configs = [
        hsdp_config(4, 3, dp=2, tp=2, micro_batch=2),
        hsdp_config(4, 1, dp=2, pp=2, micro_batch=1),
        hsdp_config(4, 2, replicas=4, micro_batch=1),
    ]
    check_layouts(4, configs, CLIP)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"replicas": 3}, r"--replicas 3 does not divide the 4 data-parallel ranks; valid: 1, 2"),
        ({"zero": 0}, r"--replicas 2 needs ZeRO \(--zero 1, 2 or 3\)"),
        ({"cp": 2, "dp": 2}, r"--replicas 2 with --cp 2 is not supported yet"),
    ],
)
def test_hsdp_refusals_name_the_flag_and_what_is_valid(change, message):
    settings = {"zero": 1, "replicas": 2, **change}
    with pytest.raises(ValueError, match=message):
        hsdp_config(4, **settings)
