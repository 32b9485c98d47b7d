"""DiLoCo on each rank of paratrain's own runtime (--dp-mode diloco, parallel/diloco.py):
what a rank holds and sends, from the same counts as a synchronous run.

Each replica group trains as a synchronous run whose data-parallel ranks are the group's
(`group_layout`: dp / R ranks, no HSDP), so a rank's inner traffic and wrappers' state are
that run's, at its place in its group (`group_coords`), on the mesh's groups of one
replica group: every data-parallel term goes over dp_shard (`within_group`). On top:
- state: the outer step's float32 global copy of every element the rank updates
  (`outer_elements`: ZeRO's unpadded shard, or the whole chunks), counted as master, and
  the outer momentum as much again, counted as optimizer state (without momentum, none);
- traffic, on an outer step (every --sync-every H steps and the last, so the last step's
  record has it): one ring all-reduce of those elements in float32 over the R groups
  (dp_replicate), and under ZeRO-1/2 the step's all-gather of the updated parameters
  once more (the wrappers rebuild the whole parameters from the shards the outer step
  wrote); an inner step sends nothing across the groups.
"""

from __future__ import annotations

from dataclasses import replace

from paratrain.plan import comm
from paratrain.plan.codec_bytes import codec_all_reduce_bytes, codec_mean_peak_bytes
from paratrain.plan.layout import Layout, Workload, flat_buffered
from paratrain.plan.lora_traffic import lora_chunks
from paratrain.plan.memory import ModelState
from paratrain.plan.model import ModelSpec
from paratrain.plan.muon_shards import unpadded_elements
from paratrain.plan.rank_experts import ExpertCounts, shares
from paratrain.plan.rank_groups import Coords, RankTraffic, shard_rank
from paratrain.plan.rank_memory import chunk_params, flat_buffers

OUTER_BYTES = 4  # the global copy, the momentum and the pseudo-gradient: float32
# a synchronous run's data-parallel groups, as one replica group's mesh names them
GROUP_AXES = {"dp": "dp_shard", "dp_cp": "dp_shard", "expert_dp": "expert_shard"}


def group_layout(layout: Layout) -> Layout:
    """One replica group's layout: dp / R data-parallel ranks, no replica groups."""
    return replace(layout, dp=layout.dp // layout.replicas, replicas=1)


def group_coords(layout: Layout, at: Coords) -> Coords:
    """A rank's place in its group's layout."""
    return replace(at, dp_rank=at.dp_rank % (layout.dp // layout.replicas))


def outer_elements(
    model: ModelSpec,
    workload: Workload,
    inner: Layout,
    at: Coords,
    experts: ExpertCounts | None = None,
) -> int:
    """Elements this rank updates (the outer step's pieces) in its group's layout `inner`:
    the unpadded part of its shard of every flat buffer when the wrappers shard (ZeRO, or
    a mixed-precision stage 0's one buffer), else its chunks whole; LoRA's adapters only;
    with experts, each share's (plan/rank_experts.py)."""
    flat = flat_buffered(workload, inner)
    if experts is not None:
        total = 0
        for share in shares(model, experts, inner, at):
            k = share.size if inner.zero else 1
            total += unpadded_elements(share.flat, k, share.rank % k) if flat else share.params
        return total
    lora = workload.lora is not None
    chunks = lora_chunks(model, inner, at.stage, workload) if lora else None
    if not flat:  # DataParallel in float32: whole parameters
        return sum(map(sum, chunks)) if chunks else sum(chunk_params(model, inner, at.stage))
    buffers = [n for chunk in (chunks or flat_buffers(model, inner, at.stage)) for n in chunk]
    k = inner.shard_ranks if inner.zero else 1
    return unpadded_elements(buffers, k, shard_rank(inner, at) % k)


def outer_state(elements: int, momentum: bool) -> ModelState:
    """The outer step's copies: the global parameters, and the momentum when it has one."""
    nbytes = OUTER_BYTES * elements
    return ModelState(params=0, grads=0, optimizer=nbytes if momentum else 0, master=nbytes)


def outer_step_peak_bytes(total: int, outer: ModelState, dtype: str, groups: int) -> int:
    """The outer step's peak (parallel/diloco.py `start`): the whole state and two float32
    copies of the pieces the rank updates, their pseudo-gradients and the flat buffer
    they are averaged in (gpt-tiny over 2 groups of 2: 10.3% under the planner's peak
    when AdamW's update counted the outer copies as its own); in a codec, beside them
    its mean's decoding of the gathered means (codec_mean_peak_bytes: in int8 +20.9%,
    bfloat16 +17.4% without it)."""
    peak = total + 2 * outer.master  # master: one float32 copy of those pieces
    if dtype == "float32" or groups == 1:
        return peak
    sizes = comm.chunk_elements(outer.master // OUTER_BYTES, groups)
    return peak + codec_mean_peak_bytes(sizes, dtype, gathered=True)


def outer_bytes(elements: int, dtype: str, groups: int, group: int) -> int:
    """What a rank sends in one outer step's mean over the groups: a float32 ring
    all-reduce, or in a codec (comm/low_precision.py) an all-to-all of its encoded chunks
    to their owners (all but its own) and a ring all-gather of the encoded means (all
    but the next rank's)."""
    if dtype == "float32":
        return comm.ring_all_reduce_rank_bytes(elements, OUTER_BYTES, groups, group)
    return codec_all_reduce_bytes(elements, dtype, groups, group)


def within_group(
    terms: list[RankTraffic], layout: Layout, at: Coords, elements: int, dtype: str
) -> list[RankTraffic]:
    """The group run's terms on the mesh's groups of one replica group, and the outer
    step's mean across the groups in `dtype` (--outer-dtype)."""
    out = [replace(t, axis=GROUP_AXES.get(t.axis, t.axis)) for t in terms]
    group, groups = at.dp_rank // (layout.dp // layout.replicas), layout.replicas
    sent = outer_bytes(elements, dtype, groups, group) if groups > 1 else 0
    out.append(RankTraffic("dp_replicate", "all_reduce", "DiLoCo's pseudo-gradient", sent))
    # ZeRO-1/2 gather the whole parameters again from the shards the outer step wrote
    again = "parameters gathered again after the outer step"
    return out + [replace(t, what=again) for t in out if t.what.endswith("updated parameters")]
