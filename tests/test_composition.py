"""Tensor x pipeline x data parallel through the training loop equals single-process training.

Each layout trains the tiny GPT (4 layers) for a few steps with gradient clipping active
(max_norm below the observed norms, so every step clips by the global norm); every rank
gathers its tensor-parallel shards back to whole parameters, the stages' parameters are put
together, and losses, gradient norms and parameters are compared with plain PyTorch
(tests/equivalence.py). Layouts whose world size matches share one set of processes.
"""

from __future__ import annotations

import pytest

from paratrain.validate import resolve_and_check
from tests.equivalence import check_layouts, tiny_config

# (dp, pp, tp, schedule, chunks, micro_batch, sequence_parallel, recompute)
LAYOUTS = {
    2: [(1, 1, 2, "1f1b", 1, 2, False, "none")],
    4: [(2, 1, 2, "1f1b", 1, 2, True, "full"), (1, 2, 2, "1f1b", 1, 2, False, "full")],
    8: [
        (2, 2, 2, "interleaved", 2, 2, False, "none"),
        (2, 2, 2, "1f1b", 1, 2, False, "full"),
        (1, 2, 4, "gpipe", 1, 2, False, "none"),
        (4, 2, 1, "1f1b", 1, 1, False, "none"),
        (2, 1, 4, "1f1b", 1, 2, True, "none"),
    ],
}
CLIP = 0.5  # below the norms observed in these runs (about 1 to 3): clipping is active


def layout_config(world, dp, pp, tp, schedule, chunks, micro_batch, sp, recompute):
    cfg = tiny_config(micro_batch=micro_batch, grad_clip=CLIP, recompute=recompute)
    cfg.model.n_layer, cfg.model.n_head = 4, 4  # 4 heads: tp = 4 owns one each
    p = cfg.parallel
    p.nproc, p.dp, p.pp, p.tp, p.schedule, p.chunks = world, dp, pp, tp, schedule, chunks
    p.sequence_parallel = sp
    cfg.train.microbatches = 0
    return resolve_and_check(cfg, world)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_layouts_match_single_process(world):
    check_layouts(world, [layout_config(world, *layout) for layout in LAYOUTS[world]], CLIP)
