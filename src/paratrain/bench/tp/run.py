"""`paratrain bench tp`: our tensor parallelism against PyTorch's DTensor tensor parallel.

Ours: `apply_tensor_parallel(model, GPT_TP_PLAN, group, sequence_parallel=...)`. Peer:
`parallelize_module` with the equivalent DTensor styles (`bench/tp_peer.py`), plus
`SequenceParallel` and `loss_parallel` where ours uses sequence parallelism and the
vocabulary-parallel loss. Both start from the same full GPT (same seed on every rank),
take the same batches and AdamW(foreach=True) at a constant learning rate, on 2 gloo ranks
with one thread each and the same timer. Each pair runs one step of each, alternating
which goes first. The report gives both medians, the median of the pairwise ratios with
their spread, the bytes each rank sends per step (ours from the ledger, the peer's from
CommDebugMode, both with the ring formulas of `comm/traffic.py`), and the largest
parameter difference at the end, both models gathered whole. The bench fails if the two
loss curves differ by more than LOSS_RTOL.

Not matched exactly: without sequence parallelism nothing (the same bytes, to the byte);
with it, the position embedding's gradient (ours: the whole table, summed with the
LayerNorm gradients in one flat all-reduce; the peer: the looked-up rows' gradients
all-gathered in backward), and the peer's LayerNorm gradients, which DTensor leaves
`Partial` so that AdamW's foreach kernels all-reduce each one per kernel that reads it.
No dropout and no gradient clipping on either side.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any

import torch
from torch import nn

from paratrain.bench.harness.spawn import run_ranks
from paratrain.config import RunConfig
from paratrain.mesh import Mesh
from paratrain.models.plans import GPT_TP_PLAN, check_gpt_tensor_parallel
from paratrain.parallel.adamw import adamw
from paratrain.parallel.replica import all_reduce_whole_grads_
from paratrain.parallel.tensor_parallel import (
    apply_tensor_parallel,
    full_state_dict,
    sequence_parallel_parameters,
)
from paratrain.train.build import build_model
from paratrain.train.data import BatchSampler, load_tokens

log = logging.getLogger(__name__)
LOSS_RTOL = 1e-4  # relative difference of the two losses allowed at every step
WORLD = 2  # on 2 cores only 2-rank timings mean anything


def _our_step(
    model: nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor, mesh: Mesh, sp: bool
) -> float:
    opt.zero_grad(set_to_none=True)
    loss = model(batch[:, :-1], batch[:, 1:])
    loss.backward()
    if sp:  # sum the partial gradients of the replicated parameters over tp
        partial = {id(p) for p in sequence_parallel_parameters(model)}
        names = [n for n, p in model.named_parameters() if id(p) in partial]
        all_reduce_whole_grads_(model, names, mesh.group("tp"))
    opt.step()
    return loss.item()


def compare_with_dtensor(
    rank: int, world: int, batches: list[torch.Tensor], sp: bool, cfg: RunConfig
) -> dict[str, Any]:
    """One rank of the comparison: per-pair times and losses, bytes, final parameters."""
    from paratrain.bench.tp import peer as tp_peer

    t = cfg.train
    mesh = Mesh.build(tp=world)
    ours = apply_tensor_parallel(
        build_model(cfg), GPT_TP_PLAN, mesh.group("tp"), sequence_parallel=sp, seed=t.seed
    )
    peer, _, plan = tp_peer.parallelize_gpt_dtensor(build_model(cfg), world, sp)
    betas = (t.beta1, t.beta2)
    ours_opt = adamw(ours, t.lr, t.weight_decay, betas)
    peer_opt = tp_peer.build_peer_adamw(peer, t.lr, t.weight_decay, betas)
    # The first (untimed) step of each counts the bytes of one whole step.
    mesh.ledger.reset()
    first = [_our_step(ours, ours_opt, batches[0], mesh, sp)]
    ours_bytes = mesh.ledger.bytes_sent()
    ours_ops = {
        op: {"calls": int(x["calls"]), "bytes_sent": int(x["bytes_sent"])}
        for g in mesh.ledger.report().values()
        for op, x in g.items()
    }
    counter = tp_peer.CommCounter(world, rank)
    with counter:
        first.append(tp_peer.peer_step(peer, peer_opt, batches[0]))
    rows = [(0.0, 0.0, first[0], first[1])]

    for i, batch in enumerate(batches[1:]):
        order = [True, False] if i % 2 == 0 else [False, True]
        times, losses = {}, {}
        for is_ours in order:
            start = time.perf_counter()
            if is_ours:
                losses[True] = _our_step(ours, ours_opt, batch, mesh, sp)
            else:
                losses[False] = tp_peer.peer_step(peer, peer_opt, batch)
            times[is_ours] = time.perf_counter() - start
        rows.append((times[True], times[False], losses[True], losses[False]))

    ours_full = full_state_dict(ours, mesh.group("tp"))
    peer_full = tp_peer.full_parameters(peer)
    diff = max((ours_full[n] - p).abs().max().item() for n, p in peer_full.items())
    return {
        "rows": rows,
        "max_param_diff": diff,
        "ours_bytes": ours_bytes,
        "ours_ops": ours_ops,
        "torch_bytes": counter.bytes_sent(),
        "torch_ops": counter.summary(),
        "torch_comm_counts": {str(k): v for k, v in counter.get_comm_counts().items()},
        "peer_plan": tp_peer.describe_plan(plan),
    }


def _summarize(results: list[dict[str, Any]], sp: bool) -> dict[str, Any]:
    rows = results[0]["rows"]
    for step, (_, _, ours_loss, peer_loss) in enumerate(rows):
        if abs(ours_loss - peer_loss) > LOSS_RTOL * abs(peer_loss):
            raise RuntimeError(
                f"step {step}: losses differ beyond {LOSS_RTOL} relative ({ours_loss} vs "
                f"{peer_loss}): the runs are not comparable"
            )
    timed = rows[1:]  # row 0 is the untimed step that counts bytes
    ratios = sorted(o / p for o, p, _, _ in timed)
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios * 3)
    return {
        "sequence_parallel": sp,
        "ours_step_s": statistics.median(r[0] for r in timed),
        "torch_step_s": statistics.median(r[1] for r in timed),
        "ratio": statistics.median(ratios),
        "ratio_min": ratios[0],
        "ratio_q1": q1,
        "ratio_q3": q3,
        "ratio_max": ratios[-1],
        "pairs": len(timed),
        "bytes_per_rank_per_step": {
            "ours": max(r["ours_bytes"] for r in results),
            "torch": max(r["torch_bytes"] for r in results),
        },
        "ops_per_step": {"ours": results[0]["ours_ops"], "torch": results[0]["torch_ops"]},
        "torch_comm_counts": results[0]["torch_comm_counts"],
        "max_param_diff": max(r["max_param_diff"] for r in results),
        "max_loss_rel_diff": max(abs(o - p) / abs(p) for _, _, o, p in rows),
        "final_loss": {"ours": rows[-1][2], "torch": rows[-1][3]},
    }


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
    cfg = cfg or RunConfig()
    t = cfg.train
    for sp in modes:
        check_gpt_tensor_parallel(cfg.model, WORLD, t.seq_len, sp)
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
        summaries.append(_summarize(results, sp))
        _log_report(summaries[-1], results[0]["peer_plan"], cfg)
    return summaries


def compare_modes(
    rank: int, world: int, batches: list[torch.Tensor], modes: tuple[bool, ...], cfg: RunConfig
) -> list[dict[str, Any]]:
    return [compare_with_dtensor(rank, world, batches, sp, cfg) for sp in modes]


def _log_report(s: dict[str, Any], peer_plan: str, cfg: RunConfig) -> None:
    m, t = cfg.model, cfg.train
    sp = s["sequence_parallel"]
    log.info(
        "GPT %d layers, d_model %d, %d heads, vocabulary %d; batch %d x %d tokens; "
        "AdamW(foreach=True, lr %.3g constant), no clipping; tp=%d on gloo, 1 thread each",
        m.n_layer, m.d_model, m.n_head, m.vocab_size, t.global_batch, t.seq_len, t.lr, WORLD,
    )  # fmt: skip
    log.info(
        "ours: apply_tensor_parallel(GPT_TP_PLAN, sequence_parallel=%s)%s",
        sp,
        " + the sequence-parallel gradient sum" if sp else "",
    )
    log.info(
        "peer: torch DTensor parallelize_module on DeviceMesh('cpu', %s), loss_parallel(); "
        "plan:\n%s",
        list(range(WORLD)),
        peer_plan,
    )
    if sp:
        log.info(
            "not matched exactly: the position embedding's gradient (ours: the whole table "
            "in the flat sequence-parallel all-reduce; peer: the looked-up rows all-gathered "
            "in backward); the peer's LayerNorm gradients stay Partial and AdamW's foreach "
            "kernels all-reduce each of them once per kernel that reads it"
        )
    log.info(
        "median step: ours %.4f s, DTensor %.4f s; ratio median %.3f (IQR %.3f-%.3f, "
        "range %.3f-%.3f) over %d pairs",
        s["ours_step_s"], s["torch_step_s"], s["ratio"], s["ratio_q1"], s["ratio_q3"],
        s["ratio_min"], s["ratio_max"], s["pairs"],
    )  # fmt: skip
    for side in ("ours", "torch"):
        ops = ", ".join(
            f"{op} {x['calls']} calls {x['bytes_sent']:,} B"
            for op, x in s["ops_per_step"][side].items()
        )
        log.info(
            "bytes sent per rank per step, %s: %s (%s)",
            side,
            f"{s['bytes_per_rank_per_step'][side]:,}",
            ops,
        )
    log.info(
        "losses agree within %.1e relative (tolerance %.0e; final %.5f vs %.5f); "
        "max parameter difference %.2e after %d steps",
        s["max_loss_rel_diff"], LOSS_RTOL, s["final_loss"]["ours"], s["final_loss"]["torch"],
        s["max_param_diff"], s["pairs"] + 1,
    )  # fmt: skip
