"""Tensor x pipeline x data parallel through the training loop equals single-process training.

Each layout trains the tiny GPT (4 layers) for a few steps with gradient clipping active
(max_norm below the observed norms, so every step clips by the global norm); every rank
gathers its tensor-parallel shards back to whole parameters, the stages' parameters are put
together, and losses, gradient norms and parameters are compared with plain PyTorch
(tests/equivalence.py). Layouts whose world size matches share one set of processes.
"""

from __future__ import annotations

import pytest

from paratrain.validate import resolve
from tests.distributed import run_distributed
from tests.equivalence import assert_layout_equivalent, tiny_config, tiny_data, train_layouts

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
    return resolve(cfg, world)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_layouts_match_single_process(world):
    data = tiny_data()
    configs = [layout_config(world, *layout) for layout in LAYOUTS[world]]
    runs = [(c.parallel.dp, c.parallel.pp, c.parallel.tp, c) for c in configs]
    per_rank = run_distributed(train_layouts, world, runs, data, timeout=600)
    for i, cfg in enumerate(configs):
        assert_layout_equivalent([r[i] for r in per_rank], cfg, data, clip=CLIP)
