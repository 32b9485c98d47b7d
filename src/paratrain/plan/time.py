"""Seconds: communication by the alpha-beta model, compute by 6 N tokens, the step.

- A message of n bytes on a link costs alpha + n / beta (Hockney 1994); a ring
  collective's per-rank cost is (its messages) alpha + (its bytes) / beta, e.g. ring
  all-reduce 2 (k - 1) alpha + 2 (k - 1) S / (k beta) (seeds, example 9.2.2: 24.5 GB at
  50 GB/s is 0.49 s, latency ignored).
- Training a dense transformer costs about 6 N FLOPs per token: 2 N forward, 4 N
  backward (Kaplan et al., arXiv:2001.08361, section 2.1); full recomputation reruns the
  forward, 8 N (arXiv:2104.04473, section 5.1). Seeds, example 9.2.2: 6 * 7e9 * 1024 *
  1024 tokens = 4.4e16 FLOPs, 440 s at 1e14 FLOP/s.
- A step is compute, plus the pipeline bubble, plus the communication not hidden behind
  compute: tensor- and pipeline-parallel traffic sits on the critical path; a fraction
  `overlap` of data-parallel traffic may hide behind the backward pass.
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.plan.cluster import ClusterSpec
from paratrain.plan.comm import CommEntry


def message_time(nbytes: float, messages: int, bandwidth: float, latency_s: float) -> float:
    """alpha-beta: messages * alpha + bytes / beta (bandwidth in bytes/s)."""
    return messages * latency_s + nbytes / bandwidth


def entry_time(entry: CommEntry, cluster: ClusterSpec) -> float:
    if entry.link == "intra":
        return message_time(entry.bytes, entry.messages, cluster.intra_bw, cluster.intra_latency_s)
    return message_time(entry.bytes, entry.messages, cluster.inter_bw, cluster.inter_latency_s)


def training_flops(n_params: int, tokens: float, recompute: str = "none") -> float:
    """6 N T, or 8 N T when every layer's forward is recomputed."""
    return (8 if recompute == "full" else 6) * n_params * tokens


def compute_time(flops: float, gpus: int, cluster: ClusterSpec) -> float:
    """flops spread evenly over `gpus`, each at peak * utilisation."""
    return flops / (gpus * cluster.effective_flops)


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    bubble_s: float
    exposed_comm_s: float
    comm_s: float  # all communication, hidden or not

    @property
    def total_s(self) -> float:
        return self.compute_s + self.bubble_s + self.exposed_comm_s


def step_time(
    compute_s: float,
    bubble_s: float,
    entries: list[CommEntry],
    cluster: ClusterSpec,
    overlap: float,
) -> StepTime:
    """Compose the step: DP traffic may be hidden up to `overlap`, the rest is exposed."""
    exposed = total = 0.0
    for e in entries:
        t = entry_time(e, cluster)
        total += t
        exposed += t * (1 - overlap) if e.axis == "dp" else t
    return StepTime(compute_s, bubble_s, exposed, total)
