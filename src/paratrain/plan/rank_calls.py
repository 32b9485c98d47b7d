"""Calls per group that each rank of a layout makes in one step, as the comm ledger
counts them: one per collective, one per send and one per receive (comm/ledger.py).

rank_traffic.py counts the bytes; the calls follow how this runtime issues them, so they
are counted here, next to the runtime they describe:
- gradients: one all-reduce per bucket without ZeRO; ZeRO-1 and ZeRO-2 one
  reduce-scatter per bucket, once per step or, ZeRO-2 with accumulate "shard", per
  micro-batch, and one all-gather of the updated parameters per wrapper. Buckets are cut
  at parameters (grad_buckets.py), so the count needs each parameter tensor in
  registration order (`ModelSpec.tensors`), not only their sum;
- ZeRO-3 (fsdp.py): per unit and micro-batch one all-gather for forward, one for
  backward (not the tied root unit, kept from forward) and one reduce-scatter;
- HSDP: one all-reduce across the replica groups per wrapper (hybrid.py, in one call);
- tensor parallelism per block and micro-batch: 4 all-reduces (2 forward, 2 backward),
  each a reduce-scatter and an all-gather with sequence parallelism; recomputation
  repeats rank_traffic.py's halves; each end 1 all-reduce (or its two halves) per
  micro-batch, the head's vocabulary-parallel loss 2 more; sequence parallelism's sum of
  the replicated gradients one all-reduce per wrapper; the norm's squares one;
- a pipeline: every message is a send on one side and a receive on the other, so a
  stage receives as many as it sends (comm.pp_traffic); the norm's sum and the loss's
  broadcast one call each;
- context parallelism: the ring's hops, each a send and a receive; all-to-all attention
  one call for q, k, v and one for the output per pass;
- the runtime's scalars (runtime_scalars.py), one all-reduce each, and the tied
  table's sum over a ZeRO group (tied_traffic.py).

Not predicted (None): experts, LoRA, Muon, --compress, DiLoCo and Megatron's pipeline
scatter/gather, whose calls follow other rules.
"""

from __future__ import annotations

from paratrain.plan.grad_buckets import chunk_tensors, flat_bucket_sizes, gradient_buckets
from paratrain.plan.layout import Layout, Workload
from paratrain.plan.model import ModelSpec
from paratrain.plan.pipeline import recomputed_layers, stage_layers, stage_virtual_stages
from paratrain.plan.rank_context import cp_exchanges
from paratrain.plan.rank_groups import AXES, Coords, group_name
from paratrain.plan.rank_memory import flat_buffers, plain_training, tied_root
from paratrain.plan.tied_traffic import tied_ends_terms


def predicted(model: ModelSpec, workload: Workload) -> bool:
    """Whether `rank_calls` counts this run (module docstring)."""
    return plain_training(model, workload) and not workload.pp_scatter_gather


def rank_calls(
    model: ModelSpec,
    workload: Workload,
    layout: Layout,
    microbatches: int,
    at: Coords,
    dropout: float = 0.0,
) -> dict[str, int | None]:
    """{group: calls per step} for every group of AXES; None for each where not predicted."""
    if not predicted(model, workload):
        return dict.fromkeys(AXES)
    calls = dict.fromkeys(AXES, 0)
    for axis, n in [
        *_gradient_calls(model, workload, layout, microbatches, at),
        *_tp_calls(model, workload, layout, microbatches, at.stage, dropout),
        *_pp_calls(layout, microbatches, at.stage),
        *_cp_calls(model, workload, layout, microbatches, at.stage),
        *_scalar_calls(model, workload, layout, at),
    ]:
        calls[axis] += n
    return calls  # type: ignore[return-value]


def _gradient_calls(
    model: ModelSpec, workload: Workload, layout: Layout, microbatches: int, at: Coords
) -> list[tuple[str, int]]:
    if layout.data_ranks == 1:
        return []
    shard, m = group_name("dp_shard", layout), microbatches
    if layout.zero == 0:
        return [(group_name("dp_cp", layout), len(gradient_buckets(model, workload, layout, at)))]
    chunks = chunk_tensors(model, layout, at.stage)
    out = [("dp_replicate", len(chunks))] if layout.replicas > 1 else []
    if layout.shard_ranks == 1:  # HSDP with one rank a group: nothing to shard over
        return out
    if layout.zero == 3:
        units = sum(len(chunk) for chunk in flat_buffers(model, layout, at.stage))
        gathers = 2 * units - (1 if tied_root(model, layout, at.stage) else 0)
        return [*out, (shard, m * (gathers + units))]
    buckets = sum(len(flat_bucket_sizes(chunk, workload)) for chunk in chunks)
    per_micro_batch = layout.zero == 2 and workload.zero2_accumulate == "shard"
    reductions = buckets * (m if per_micro_batch else 1)
    gathers = len(chunks) if layout.zero else 0
    return [*out, (shard, reductions + gathers)]


def _tp_calls(
    model: ModelSpec,
    workload: Workload,
    layout: Layout,
    microbatches: int,
    stage: int,
    dropout: float,
) -> list[tuple[str, int]]:
    if layout.tp == 1:
        return []
    sequence_parallel = layout.sequence_parallel
    s, c = layout.pp, layout.chunks
    mine = stage_virtual_stages(stage, s, c)
    layers = stage_layers(model.shape.n_layer, stage, s, c)
    again = 0  # recomputation's repeats as rank_traffic.py counts them, per time it runs
    if workload.recompute != "none":
        again = 4 if dropout else (3 if sequence_parallel else 2)
    recomputed = recomputed_layers(model.shape.n_layer, stage, s, c, layout.schedule)
    ends = (0 in mine) + (s * c - 1 in mine)
    per_micro_batch = layers * 8 + recomputed * again + 2 * ends  # 4 all-reduces a block
    per_micro_batch = per_micro_batch if sequence_parallel else per_micro_batch // 2
    loss = 2 if s * c - 1 in mine else 0  # the vocabulary-parallel loss's two statistics
    wrappers = len(mine) if sequence_parallel else 0  # their replicated gradients' sums
    return [("tp", microbatches * (per_micro_batch + loss) + wrappers + 1)]  # + the norm


def _pp_calls(layout: Layout, microbatches: int, stage: int) -> list[tuple[str, int]]:
    s, c = layout.pp, layout.chunks
    if s == 1:
        return []
    last = s * c - 1
    sends = microbatches * sum((vs < last) + (vs > 0) for vs in stage_virtual_stages(stage, s, c))
    return [("pp", 2 * sends + 2)]  # the receives; the norm's sum, the loss's broadcast


def _cp_calls(
    model: ModelSpec, workload: Workload, layout: Layout, microbatches: int, stage: int
) -> list[tuple[str, int]]:
    """Two calls an exchange: a hop's send and receive, or a pass's two all-to-alls."""
    if layout.cp == 1:
        return []
    return [("cp", 2 * cp_exchanges(model, workload, layout, microbatches, stage))]


def _scalar_calls(
    model: ModelSpec, workload: Workload, layout: Layout, at: Coords
) -> list[tuple[str, int]]:
    """runtime_scalars.py' all-reduces on dp_cp and dp_shard (tp's and pp's are
    counted with their groups), and the tied table's sum over the ZeRO group."""
    out = [(group_name("dp_cp", layout), 1)] if layout.data_ranks > 1 else []
    if layout.zero and layout.shard_ranks > 1:  # the shards' squared norms
        out.append((group_name("dp_shard", layout), 1))
    tied = tied_ends_terms(model, workload, layout, at)
    return out + [(t.axis, 1) for t in tied]
