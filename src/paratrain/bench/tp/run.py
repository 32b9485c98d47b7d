"""`paratrain bench tp`: our tensor parallelism against PyTorch's DTensor tensor parallel.

Ours: the engine `paratrain train --tp 2` builds (`apply_tensor_parallel(model,
GPT_TP_PLAN, group, sequence_parallel=...)`) and the one `train_step`. Peer:
`parallelize_module` with the equivalent DTensor styles (peer.py), plus `SequenceParallel`
and `loss_parallel` where ours uses sequence parallelism and the vocabulary-parallel loss.
Both start from the same full GPT (same seed on every rank), take the same batches, clip
at the same global gradient norm and run AdamW(foreach=True) at a constant learning rate,
on 2 gloo ranks with one thread each and the same timer (compare.py). Each pair runs one
step of each, alternating which goes first. The report (report.py) gives both medians,
the median of the pairwise ratios with their spread, the bytes each rank sends per step
(ours from the ledger, the peer's counted at the dispatcher, both with the ring formulas
of `comm/traffic.py`), each side's gradient-norm traffic apart, and the largest parameter
difference at the end, both models gathered whole. The bench fails if the two loss
curves differ by more than LOSS_RTOL.

Not matched exactly: without sequence parallelism only the gradient norm (ours: one
float64 squared sum all-reduced over tp; the peer: DTensor's per-parameter norms made
whole), so the rest is the same bytes, to the byte;
with it, the position embedding's gradient (ours: the whole table, summed with the
LayerNorm gradients in one flat all-reduce; the peer: the looked-up rows' gradients
all-gathered in backward), and the peer's LayerNorm gradients, which DTensor leaves
`Partial` so that AdamW's foreach kernels all-reduce each one per kernel that reads it.
No dropout on either side.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from paratrain.bench.harness.sides import norm_only
from paratrain.bench.tp.compare import compare_modes
from paratrain.bench.tp.report import log_report, summarize
from paratrain.config import RunConfig
from paratrain.data.tokens import BatchSampler, load_tokens
from paratrain.models.plans import check_tensor_parallel
from paratrain.spawn import run_ranks

log = logging.getLogger(__name__)
WORLD = 2  # on 2 cores only 2-rank timings mean anything


def run_tp_bench(
    pairs: int = 20,
    sequence_parallel: bool = False,
    cfg: RunConfig | None = None,
    tokens: torch.Tensor | None = None,
) -> dict[str, Any]:
    """Run the comparison on WORLD ranks and log the report; return the summary.

    `cfg` defaults to our default configuration (model, seq_len, global batch, AdamW
    settings); `tokens` to the training split of `cfg.data.path`. Raises RuntimeError if
    the two loss curves differ by more than LOSS_RTOL.
    """
    return run_tp_comparisons(pairs, (sequence_parallel,), cfg, tokens)[0]


def run_tp_comparisons(
    pairs: int,
    modes: tuple[bool, ...],
    cfg: RunConfig | None = None,
    tokens: torch.Tensor | None = None,
) -> list[dict[str, Any]]:
    """`run_tp_bench` for each sequence-parallel mode in `modes`, in one launch of the
    ranks (importing DTensor costs each fresh rank seconds)."""
    torch.set_num_threads(1)
    cfg = norm_only(cfg or RunConfig())
    t = cfg.train
    for sp in modes:
        check_tensor_parallel(cfg.model, WORLD, t.seq_len, sp)
    if cfg.model.dropout:
        raise ValueError(f"dropout {cfg.model.dropout}: the bench compares without dropout")
    if tokens is None:
        tokens = load_tokens(cfg.data.path, cfg.data.val_fraction).train
    # Every tp rank takes the whole batch: tensor parallelism splits the model, not data.
    sampler = BatchSampler(tokens, t.seq_len, t.global_batch, t.seed)
    batches = [sampler.global_batch_at(s) for s in range(pairs + 1)]
    per_rank = run_ranks(compare_modes, WORLD, batches, modes, cfg, timeout=1800)
    summaries = []
    for i, sp in enumerate(modes):
        results = [rank_results[i] for rank_results in per_rank]
        summaries.append(summarize(results, sp))
        log_report(summaries[-1], results[0]["peer_plan"], cfg)
    return summaries
