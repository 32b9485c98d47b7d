"""ZeRO, FSDP and mixed precision through the training loop (`--zero`, `--dtype`), alone
and composed with tensor and pipeline parallelism, against plain single-process PyTorch.

float32 runs must be equivalent within tests/equivalence.py's tolerances (clipping active
on every step, so the sharded global norm is exercised). The bfloat16 run is compared
loosely: it must train and stay within a few percent of the float32 loss.
"""

from __future__ import annotations

import pytest

from paratrain.mesh import Mesh
from paratrain.train.loop import train
from paratrain.validate import resolve_and_check
from tests.distributed import run_distributed
from tests.equivalence import check_layouts, tiny_config, tiny_data

# (dp, pp, tp, zero, schedule, micro_batch[, ZeRO-2 accumulation (None: the default,
# shard)[, sequence parallel[, recompute]]])
LAYOUTS = {
    2: [
        (2, 1, 1, 1, "1f1b", 2),
        (2, 1, 1, 2, "1f1b", 2, "full"),  # K = 2 accumulated whole, one reduce-scatter
        (2, 1, 1, 2, "1f1b", 1),  # the default: K = 4 reduce-scatters into the shard
        (2, 1, 1, 3, "1f1b", 2),
    ],
    4: [
        (4, 1, 1, 3, "1f1b", 1),
        (2, 1, 2, 2, "1f1b", 2, "full"),
        (2, 2, 1, 2, "1f1b", 1, "shard"),
        # Sequence parallelism's partial LayerNorm gradients summed in the ZeRO shards.
        (2, 1, 2, 1, "1f1b", 2, None, True),
        (2, 1, 2, 2, "1f1b", 1, "shard", True),
        (2, 1, 2, 3, "1f1b", 2, None, True),
        (4, 1, 1, 3, "1f1b", 1, None, False, "full"),  # FSDP with recomputed blocks
    ],
    8: [(2, 2, 2, 1, "1f1b", 2), (2, 2, 2, 2, "1f1b", 2)],
}
CLIP = 0.5


def layout_config(
    world,
    dp,
    pp,
    tp,
    zero,
    schedule,
    micro_batch,
    accumulate=None,
    sp=False,
    recompute="none",
    dtype="float32",
):
    cfg = tiny_config(micro_batch=micro_batch, grad_clip=CLIP, dtype=dtype, recompute=recompute)
    cfg.model.n_layer = 4
    p = cfg.parallel
    p.nproc, p.dp, p.pp, p.tp, p.zero, p.schedule = world, dp, pp, tp, zero, schedule
    p.zero2_accumulate = accumulate or p.zero2_accumulate
    p.sequence_parallel = sp
    cfg.train.microbatches = 0
    return resolve_and_check(cfg, world)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_zero_layouts_match_single_process(world):
    check_layouts(world, [layout_config(world, *layout) for layout in LAYOUTS[world]], CLIP)


def bf16_run(rank, world_size, data):
    out = []
    for dtype in ("float32", "bfloat16"):
        cfg = layout_config(2, 2, 1, 1, 1, "1f1b", 2, dtype=dtype)
        cfg.train.steps = 6
        out.append([m.loss for m in train(cfg, Mesh.build(dp=2), data).metrics])
    return out


def test_bfloat16_with_zero_trains_close_to_float32():
    fp32, bf16 = run_distributed(bf16_run, 2, tiny_data(), timeout=600)[0]
    assert bf16[-1] < bf16[0] - 0.5
    for a, b in zip(fp32, bf16, strict=True):
        assert abs(a - b) / a < 0.03, (fp32, bf16)
