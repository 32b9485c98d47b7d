"""A rank's peak memory: its model state alive then, its stage's activations as our
runtime saves them on the run's device, and on the last stage what the loss holds at its
peak (plan/activations.py). `paratrain simulate` holds it within 5% of the measured peak
(docs/planner.md); not counted yet: pipeline chunk outputs kept for backward, the
recomputed block's transient, ZeRO's gathered units and buffers, the optimizer update's
temporaries.
"""

from __future__ import annotations

from paratrain.plan import activations
from paratrain.plan.layout import Layout, Workload, flat_buffered
from paratrain.plan.model import ModelSpec


def state_at_peak(
    workload: Workload, layout: Layout, state: dict[str, int], first_step: bool
) -> int:
    """The model state (a rank's params, grads, optimizer, master and total) alive at the
    step's peak, at the loss or in backward: the optimizer's state is made by the first
    step's update, after that step's backward; and DataParallel without flat buffers over
    a group of one keeps no gradient buckets and drops its gradients before each forward
    (data_parallel/wrapper.py `zero_grad`)."""
    alive = state["total"] - (state["optimizer"] if first_step else 0)
    alone = not flat_buffered(workload, layout) and layout.dp * layout.cp == 1
    return alive - (state["grads"] if alone else 0)


def rank_peak_bytes(
    model: ModelSpec,
    workload: Workload,
    layout: Layout,
    microbatches: int,
    stage: int,
    state: int,
    device: str,
) -> tuple[float, float] | None:
    """(peak, activations) of a rank of pipeline stage `stage` whose state alive at the
    peak is `state` (state_at_peak); None when the model has no shape."""
    acts = activations.stage_activation_bytes(
        model, workload, layout, microbatches, stage, "fused", device
    )
    if acts is None:
        return None
    peak = state + acts
    if stage == layout.pp - 1:  # the loss, whose tokens cp splits
        peak += activations.loss_transient_bytes(model, workload, layout.tp) / layout.cp
    return peak, acts
