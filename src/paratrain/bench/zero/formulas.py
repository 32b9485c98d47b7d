"""The closed forms `paratrain bench zero` puts beside its measurements, per rank.

- Model state: the planner's `model_state_bytes` (plan/memory.py): float32 AdamW without a
  master copy, 16N, 8N + 8N/k, 4N + 12N/k, 16N/k for stages 0-3.
- Bytes sent per step: the ZeRO paper's (section 7), 2(k-1)S/k for stages 0-2 and
  3(k-1)S/k for stage 3, S = 4N (sharded stages pad S to k ceil(N/k) elements, as the
  planner does, plan/comm.py); and, labelled apart, the runtime's bookkeeping scalars
  that our one step adds (plan/runtime_scalars.py): the (loss, tokens) pair and,
  under ZeRO, the gradient norm's two squared sums, each a float64 all-reduce over dp.
- HSDP (R replica groups of s = k / R ranks): ZeRO-3's forms with s for k, and the
  all-reduce of the gradient shard over the R groups, 2(R-1)/R of 4 ceil(N/s) bytes.
"""

from __future__ import annotations

import math

from paratrain.plan.comm import all_reduce_bytes
from paratrain.plan.layout import PRECISIONS, Layout, Workload
from paratrain.plan.memory import model_state_bytes
from paratrain.plan.rank_traffic import Coords
from paratrain.plan.runtime_scalars import runtime_scalars


def formula_state(
    n_params: int, zero: int, dp: int, dtype: str = "float32", replicas: int = 1
) -> dict[str, int]:
    """The planner's model-state bytes per rank for AdamW, by kind and `total`.

    float32: no master copy (16N, 8N + 8N/k, 4N + 12N/k, 16N/k); 16-bit: mixed precision
    with fp32 master weights and moments (16N, 4N + 12N/k, 2N + 14N/k, 16N/k).
    """
    precision = PRECISIONS["fp32" if dtype == "float32" else "mixed"]
    workload = Workload(precision=precision, optimizer="adam")
    layout = Layout(dp=dp, zero=zero, replicas=replicas)
    return model_state_bytes(n_params, workload, layout).as_dict()


def formula_comm(n_params: int, zero: int, dp: int, replicas: int = 1) -> int:
    """The ZeRO paper's bytes sent per rank per step (float32, ring); under HSDP within a
    replica group, plus the shard's all-reduce across the groups."""
    if zero == 0:
        return all_reduce_bytes(4 * n_params, dp)
    k = dp // replicas
    shard = math.ceil(n_params / k)
    per_pass = (k - 1) * shard * 4  # one reduce-scatter or all-gather
    return (2 if zero < 3 else 3) * per_pass + all_reduce_bytes(4 * shard, replicas)


def scalar_bytes(zero: int, dp: int, replicas: int = 1) -> list[int]:
    """Per dp rank, the bytes our step's bookkeeping scalars send (the planner's terms)."""
    layout = Layout(dp=dp, zero=zero, replicas=replicas)
    return [sum(t.bytes for t in runtime_scalars(layout, Coords(dp_rank=r))) for r in range(dp)]
