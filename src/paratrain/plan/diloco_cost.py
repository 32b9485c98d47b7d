"""--dp-mode diloco in `paratrain plan`'s cluster estimates (docs/diloco.md): each of the
R replica groups trains as a synchronous run of dp / R ranks (plan/rank_diloco.py
`group_layout`), and every H steps the groups take an outer step together, from the same
counts as the per-rank prediction (rank_diloco.py) at the estimates' resolution (one
buffer of N / (tp pp) local parameters per GPU).

Per step, on top of the group's own traffic (its data-parallel entries renamed dp_shard):
the outer step's mean of the GPU's pieces over the R groups (float32 ring all-reduce, or
--outer-dtype's codec) and under ZeRO-1/2 the parameters' all-gather once more, each
divided by H (the outer step's cost spread over the steps between two; its messages
rounded up). State: the global copy and the outer momentum of those pieces, float32, as
master and optimizer state. A step's time is then the group's plus that share; the real
outer step lands once every H steps, all at once (Streaming DiLoCo's fragments spread it,
the same bytes in all).
"""

from __future__ import annotations

import math
from dataclasses import replace

from paratrain.plan import comm
from paratrain.plan.cluster import ClusterSpec
from paratrain.plan.comm import CommEntry
from paratrain.plan.layout import Layout, Workload
from paratrain.plan.memory import ModelState, local_params
from paratrain.plan.model import ModelSpec
from paratrain.plan.rank_diloco import GROUP_AXES, OUTER_BYTES, group_layout, outer_bytes

GATHER = "updated parameters"


def outer_pieces(model: ModelSpec, layout: Layout) -> int:
    """Elements of a GPU's pieces: its ZeRO shard in its group, or its parameters whole."""
    n = local_params(model.params, layout.tp, layout.pp)
    inner = group_layout(layout)
    return math.ceil(n / inner.shard_ranks) if inner.zero else n


def diloco_traffic(
    model: ModelSpec, workload: Workload, layout: Layout, cluster: ClusterSpec, k_mb: int
) -> list[CommEntry]:
    """One GPU's traffic per step, the outer step's spread over H (module docstring)."""
    inner, h = group_layout(layout), workload.sync_every
    out = [
        replace(e, axis=GROUP_AXES.get(e.axis, e.axis))
        for e in comm.traffic(model, workload, inner, cluster, k_mb)
    ]
    pieces, r = outer_pieces(model, layout), layout.replicas
    link = comm.axis_link("dp_replicate", layout, cluster)
    sent = outer_bytes(pieces, workload.outer_dtype, r, 0)
    what = f"DiLoCo's pseudo-gradient, every {h} steps, per step"
    out.append(CommEntry("all_reduce", "dp_replicate", link, what, sent // h,
                         math.ceil(2 * (r - 1) / h)))  # fmt: skip
    again = [e for e in out if e.what == GATHER]  # ZeRO-1/2 gather again after the step
    return out + [
        replace(
            e,
            what=f"{GATHER}, again after the outer step",
            bytes=e.bytes // h,
            messages=math.ceil(e.messages / h),
        )  # fmt: skip
        for e in again
    ]


def diloco_state(model: ModelSpec, workload: Workload, layout: Layout) -> ModelState:
    """The outer step's float32 copies of a GPU's pieces: the global parameters (as
    master) and the outer momentum (as optimizer state)."""
    nbytes = OUTER_BYTES * outer_pieces(model, layout)
    return ModelState(params=0, grads=0, optimizer=nbytes, master=nbytes)


def diloco_problems(workload: Workload, layout: Layout) -> list[str]:
    """Why `paratrain train` would refuse DiLoCo on this layout (validate/rules_diloco.py)."""
    if workload.sync_every and layout.replicas < 2:
        return ["--dp-mode diloco needs replica groups: --replicas 2 or more"]
    return []
