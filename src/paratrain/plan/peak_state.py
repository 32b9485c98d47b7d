"""The model state alive at a rank's peak (plan/rank_peak.py): what of the state the
planner counts (plan/memory.py) exists at that moment of the step."""

from __future__ import annotations

from paratrain.plan.activations import in_flight_chunks
from paratrain.plan.layout import Layout, Workload, flat_buffered


def state_at_peak(
    workload: Workload,
    layout: Layout,
    state: dict[str, int],
    first_step: bool,
    microbatches: int,
    stage: int,
    diloco: bool = False,
) -> int:
    """The model state (a rank's params, grads, optimizer, master and total) alive at the
    step's peak, at the loss or in backward: the optimizer's state is made by the first
    step's update, after that step's backward, but under DiLoCo before the first step:
    its outer step is built over the pieces a checkpoint saves (train/diloco.py), whose
    moments AdamW makes then, and it makes its own momentum (`diloco zero1 dp 64 in 4
    groups, int8`, tests/test_simulate.py: +7.0% with both taken away). And DataParallel
    without flat buffers over a group of one keeps no gradient buckets and drops its
    gradients before each forward (data_parallel/wrapper.py `zero_grad`): where every
    forward of the step runs first (one micro-batch, or GPipe) they are gone at the
    peak, which comes before any backward, unless recomputation keeps so little that the
    gradients backward makes outweigh what it frees. Then the peak is in backward and
    counted with every gradient beside the activations, an upper bound: GPipe with full
    recomputation over pp 2, both stages, gpt-tiny and llama-tiny, +2.7% to +6.8%
    without them, -3.7% to -4.4% with them (the micro-batch in backward has let go of
    some of its own)."""
    alive = state["total"] - (state["optimizer"] if first_step and not diloco else 0)
    alone = not flat_buffered(workload, layout) and layout.dp * layout.cp == 1
    every_forward_first = in_flight_chunks(layout, microbatches, stage) == (
        microbatches * layout.chunks
    )
    before_backward = every_forward_first and workload.recompute == "none"
    return alive - (state["grads"] if alone and before_backward else 0)
