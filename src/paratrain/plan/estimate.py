"""One layout evaluated: memory, traffic, bubble and time, and whether (and why not) it fits.

This is where the other modules meet; each number is computed by exactly one of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from paratrain.plan import comm, memory, pipeline
from paratrain.plan import time as ptime
from paratrain.plan.cluster import GB, ClusterSpec
from paratrain.plan.layout import Layout, Workload, microbatches_for
from paratrain.plan.model import ModelSpec


@dataclass
class Estimate:
    layout: Layout
    model_state: memory.ModelState
    microbatches: int | None = None
    global_batch: int | None = None
    activation_bytes: float | None = None  # None: not counted (model without a shape)
    comm: list[comm.CommEntry] = field(default_factory=list)
    bubble: float | None = None
    time: ptime.StepTime | None = None
    train_time_s: float | None = None
    redundant_bytes: int = 0
    problems: list[str] = field(default_factory=list)
    capacity_bytes: float = 0.0

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def memory_bytes(self) -> float:
        return self.model_state.total + (self.activation_bytes or 0.0)

    @property
    def comm_bytes(self) -> int:
        return sum(e.bytes for e in self.comm)

    @property
    def messages(self) -> int:
        return sum(e.messages for e in self.comm)

    @property
    def reason(self) -> str:
        if self.problems:
            return "; ".join(self.problems)
        free = (self.capacity_bytes - self.memory_bytes) / GB
        note = "" if self.activation_bytes is not None else " (activations not counted)"
        used, cap = self.memory_bytes / GB, self.capacity_bytes / GB
        return f"fits: {used:.2f} of {cap:.0f} GB, {free:.2f} GB free{note}"

    def as_dict(self) -> dict[str, Any]:
        """The JSON entry; the first keys are the ones the planner issue names."""
        lay, t = self.layout, self.time
        act = self.activation_bytes
        return {
            "dp": lay.dp,
            "tp": lay.tp,
            "pp": lay.pp,
            "zero": lay.zero,
            "schedule": lay.schedule or None,
            "model_state_bytes_per_gpu": self.model_state.as_dict(),
            "activation_bytes_per_gpu": None if act is None else round(act),
            "comm_bytes_per_gpu": self.comm_bytes,
            "bubble_fraction": self.bubble,
            "step_time_s": None if t is None else t.total_s,
            "fits": self.fits,
            "reason": self.reason,
            "label": lay.label,
            "chunks": lay.chunks,
            "microbatches": self.microbatches,
            "global_batch": self.global_batch,
            "comm": [e.as_dict() for e in self.comm],
            "messages_per_step": self.messages,
            "time": None
            if t is None
            else {
                "compute_s": t.compute_s,
                "bubble_s": t.bubble_s,
                "exposed_comm_s": t.exposed_comm_s,
                "comm_s": t.comm_s,
            },
            "train_time_s": self.train_time_s,
            "redundant_bytes": self.redundant_bytes,
        }


def shape_problems(model: ModelSpec, cluster: ClusterSpec, layout: Layout) -> list[str]:
    """Reasons a layout cannot run at all, whatever the memory."""
    problems = []
    if layout.world != cluster.gpus:
        problems.append(f"dp*tp*pp = {layout.world} but the cluster has {cluster.gpus} GPUs")
    if layout.tp > cluster.gpus_per_node:
        problems.append(
            f"tensor parallel {layout.tp} spans nodes of {cluster.gpus_per_node} GPUs "
            "(its per-layer all-reduces need NVLink)"
        )
    if layout.zero >= 2 and layout.pp > 1:
        problems.append(
            f"ZeRO-{layout.zero} with pipeline parallelism reduce-scatters gradients every "
            "micro-batch (DeepSpeed refuses it); use ZeRO-1"
        )
    if model.has_shape:
        if model.n_head % layout.tp:  # type: ignore[operator]
            problems.append(f"tp {layout.tp} does not divide {model.n_head} heads")
        if model.n_layer % (layout.pp * layout.chunks):  # type: ignore[operator]
            problems.append(
                f"{model.n_layer} layers do not split into pp {layout.pp} x chunks {layout.chunks}"
            )
    return problems


def estimate(
    model: ModelSpec, cluster: ClusterSpec, workload: Workload, layout: Layout
) -> Estimate:
    """Evaluate one layout. Never raises for a layout that cannot run: it records why."""
    state = memory.model_state_bytes(model.params, workload, layout)
    est = Estimate(layout, state, capacity_bytes=cluster.gpu_memory_bytes)
    est.problems = shape_problems(model, cluster, layout)
    est.redundant_bytes = memory.redundant_bytes(model.params, workload, layout)
    try:
        k = microbatches_for(workload, layout)
        est.comm = comm.traffic(model, workload, layout, cluster, k)
    except ValueError as e:
        est.problems.append(str(e))
        return est
    est.microbatches, est.global_batch = k, k * workload.micro_batch * layout.dp
    est.activation_bytes = memory.activation_bytes(model, workload, layout, k)
    est.bubble = pipeline.bubble_fraction(layout.pp, k, layout.chunks, layout.schedule)
    tokens = est.global_batch * (model.seq_len or 0)
    flops = ptime.training_flops(model.params, tokens, workload.recompute)
    compute_s = ptime.compute_time(flops, layout.world, cluster)
    bubble_s = pipeline.bubble_time(compute_s, layout.pp, k, layout.chunks, layout.schedule)
    est.time = ptime.step_time(compute_s, bubble_s, est.comm, cluster, workload.overlap)
    if tokens:
        est.train_time_s = est.time.total_s * workload.train_tokens / tokens
    if est.memory_bytes > cluster.gpu_memory_bytes:
        est.problems.append(
            f"needs {est.memory_bytes / GB:.2f} GB per GPU ({state.total / GB:.2f} model state"
            + (f" + {est.activation_bytes / GB:.2f} activations" if est.activation_bytes else "")
            + f") of {cluster.gpu_memory_bytes / GB:.0f} GB"
        )
    return est
