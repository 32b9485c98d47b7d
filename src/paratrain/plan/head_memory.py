"""What the last stage's loss and head hold beyond its blocks, per micro-batch: the fp32
logits that the stage count charges (plan/activations.py), and what the head's own
backward makes once the loss has let go of them (rank_peak.py counts both candidates).
"""

from __future__ import annotations

from paratrain.plan.layout import Layout, Workload
from paratrain.plan.model import ModelSpec


def logits_bytes(model: ModelSpec, workload: Workload, layout: Layout) -> float:
    """The stage count's charge for the loss: fp32 logits, 4 s b V / t, over the whole
    sequence (a cp rank holds a cp-th of it: the callers divide, as the stage count
    divides its sum)."""
    s, b, t = model.shape.seq_len, workload.micro_batch, layout.tp
    return 4 * s * b * model.shape.vocab_size / t


def zb_h1_logits_bytes(model: ModelSpec, workload: Workload, layout: Layout, stage: int) -> float:
    """The logits that ZB-H1's last stage holds for one graph only: a weight pass keeps
    the head's node, not the loss above it, so each graph's loss goes as its input pass
    ends (activations.stage_activation_bytes); 0 elsewhere."""
    if layout.schedule != "zb-h1" or stage != layout.pp - 1 or layout.pp == 1:
        return 0.0
    return logits_bytes(model, workload, layout)


def head_backward_bytes(model: ModelSpec, workload: Workload, layout: Layout) -> float:
    """What the head's backward holds once the loss's backward has returned and let go of
    what the loss saved (the charge, `logits_bytes`): the logits' gradient, e s b V / t,
    and what the head's matmul makes from it, its input's gradient (e s b h) and its
    weight's, V / t x h in the gradients' dtype, which autograd makes whole before adding
    it to the buffer that holds the weight's gradient. tp 2 x pp 4 interleaved, ZeRO-1,
    the last stage: +7.1% without it (docs/planner.md)."""
    m, b, t, p = model.shape, workload.micro_batch, layout.tp, workload.precision
    tokens = m.seq_len * b / layout.cp
    e = p.activation_bytes
    return tokens * e * (m.vocab_size / t + m.d_model) + m.vocab_size / t * m.d_model * p.grad_bytes
