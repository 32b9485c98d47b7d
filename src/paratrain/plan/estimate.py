"""One layout evaluated: memory, traffic, bubble and time, and whether (and why not) it fits.

This is where the other modules meet; each number is computed by exactly one of them.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, field, replace
from typing import Any

from paratrain.plan import activations, comm, context, memory, moe, pipeline, stage_time
from paratrain.plan import time as ptime
from paratrain.plan.cluster import GB, ClusterSpec
from paratrain.plan.compress_cost import (
    compress_problems,
    compressed_traffic,
    gpu_compress_bytes,
)
from paratrain.plan.diloco_cost import diloco_problems, diloco_state, diloco_traffic
from paratrain.plan.expert_traffic import ep_traffic
from paratrain.plan.layout import Layout, Workload, microbatches_for
from paratrain.plan.lora import lora_model_state
from paratrain.plan.model import ModelSpec
from paratrain.plan.rank_diloco import group_layout


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
    model_flops: float | None = None  # the step's FLOPs as time.model_training_flops counts
    peak_flops: float = 0.0  # per GPU, for the MFU
    redundant_bytes: int = 0
    problems: list[str] = field(default_factory=list)
    capacity_bytes: float = 0.0
    zero2_accumulate: str | None = None  # the option charged, for ZeRO-2 layouts
    alternative: Estimate | None = None  # ZeRO-2 with K > 1: the same, the other option

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
    def gradient_comm_bytes(self) -> int:
        """Data-parallel gradient traffic: the all-reduce or reduce-scatters of gradients."""
        return sum(
            e.bytes for e in self.comm if e.axis in comm.GRADIENT_AXES and "gradient" in e.what
        )

    @property
    def model_tflops_per_gpu(self) -> float | None:
        """Model FLOPs over the step time, per GPU, in TFLOP/s (what papers publish)."""
        if self.time is None or not self.model_flops or not self.time.total_s:
            return None
        return self.model_flops / (self.layout.world * self.time.total_s) / 1e12

    @property
    def mfu(self) -> float | None:
        """model_tflops_per_gpu over the GPU's datasheet peak (not the calibrated rate)."""
        tflops = self.model_tflops_per_gpu
        return None if tflops is None else tflops * 1e12 / self.peak_flops

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
            "cp": lay.cp,
            "cp_method": lay.cp_method if lay.cp > 1 else None,
            "ep": lay.ep,
            "zero": lay.zero,
            "replicas": lay.replicas,  # HSDP's replica groups; 1 without
            "schedule": lay.schedule or None,
            "model_state_bytes_per_gpu": self.model_state.as_dict(),
            "activation_bytes_per_gpu": None if act is None else round(act),
            "comm_bytes_per_gpu": self.comm_bytes,
            "bubble_fraction": self.bubble,
            "step_time_s": None if t is None else t.total_s,
            "model_tflops_per_gpu": self.model_tflops_per_gpu,
            "mfu": self.mfu,
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
                "memory_bound_s": t.memory_s,
                "bubble_s": t.bubble_s,
                "exposed_comm_s": t.exposed_comm_s,
                "comm_s": t.comm_s,
            },
            "train_time_s": self.train_time_s,
            "redundant_bytes": self.redundant_bytes,
            "gradient_comm_bytes_per_gpu": self.gradient_comm_bytes,
            "zero2_accumulate": self.zero2_accumulate,
            "zero2_alternative": None if self.alternative is None else self.alternative.summary(),
        }

    def summary(self) -> dict[str, Any]:
        """The figures that differ between ZeRO-2's two accumulation options."""
        s, t = self.model_state, self.time
        return {
            "zero2_accumulate": self.zero2_accumulate,
            "grads": s.grads,
            "grad_accumulation": s.grad_accumulation,
            "model_state_total": s.total,
            "memory_bytes_per_gpu": round(self.memory_bytes),
            "gradient_comm_bytes_per_gpu": self.gradient_comm_bytes,
            "comm_bytes_per_gpu": self.comm_bytes,
            "messages_per_step": self.messages,
            "step_time_s": None if t is None else t.total_s,
            "fits": self.fits,
            "reason": self.reason,
        }


def shape_problems(model: ModelSpec, cluster: ClusterSpec, layout: Layout) -> list[str]:
    """Reasons a layout cannot run at all, whatever the memory.

    ZeRO-2 with a pipeline runs (the runtime takes either accumulation option); with
    accumulate shard its K-fold gradient traffic is what DeepSpeed refuses it for, and
    comm.py charges it.
    """
    problems = []
    if layout.world != cluster.gpus:
        problems.append(f"dp*cp*tp*pp = {layout.world} but the cluster has {cluster.gpus} GPUs")
    if layout.tp > cluster.gpus_per_node:
        problems.append(
            f"tensor parallel {layout.tp} spans nodes of {cluster.gpus_per_node} GPUs "
            "(its per-layer all-reduces need NVLink)"
        )
    problems += context.cp_problems(model, layout)
    if layout.ep > 1 and model.num_experts % layout.ep:
        problems.append(f"ep {layout.ep} does not divide {model.num_experts} experts")
    if layout.zero == 3 and layout.pp > 1:  # refused at run time too (validate/)
        problems.append(
            "ZeRO-3 with pipeline parallelism gathers the stage's parameters again for every "
            "micro-batch (DeepSpeed refuses it); use ZeRO-1 or 2"
        )
    if model.has_shape:
        if model.shape.n_head % layout.tp:
            problems.append(f"tp {layout.tp} does not divide {model.n_head} heads")
        elif model.n_kv_head and model.n_kv_head % layout.tp:  # as models/plans.py refuses
            problems.append(f"tp {layout.tp} does not divide {model.n_kv_head} key/value heads")
        if model.shape.n_layer % (layout.pp * layout.chunks):
            problems.append(
                f"{model.n_layer} layers do not split into pp {layout.pp} x chunks {layout.chunks}"
            )
    return problems


def model_state(
    model: ModelSpec, workload: Workload, layout: Layout, microbatches: int = 1
) -> memory.ModelState:
    """The dense parameters' states over the dp_cp group; a mixture of experts' experts,
    1/ep of them, over the expert_dp group (plan/moe.py)."""
    if workload.lora is not None:  # a dense model (LoRA refuses experts)
        return lora_model_state(model, workload.lora, workload, layout)
    experts = moe.all_expert_params(model)
    if workload.sync_every and layout.replicas > 1:  # DiLoCo: a group's run, the outer copies
        state = memory.model_state_bytes(model.params, workload, group_layout(layout))
        return memory.ModelState(*map(sum, zip(astuple(state), astuple(diloco_state(
            model, workload, layout)), strict=True)))  # fmt: skip
    state = memory.model_state_bytes(model.params - experts, workload, layout, microbatches)
    errors = gpu_compress_bytes(model, workload, layout)  # --compress's, as gradients
    state = replace(state, grads=state.grads + errors)
    if not experts:
        return state
    expert_layout = replace(layout, dp=layout.data_ranks // layout.ep, cp=1, ep=1)
    part = memory.model_state_bytes(experts // layout.ep, workload, expert_layout, microbatches)
    return memory.ModelState(*(a + b for a, b in zip(astuple(state), astuple(part), strict=True)))


def estimate(
    model: ModelSpec,
    cluster: ClusterSpec,
    workload: Workload,
    layout: Layout,
    alternative: bool = True,
) -> Estimate:
    """Evaluate one layout. Never raises for a layout that cannot run: it records why.

    For ZeRO-2 with K > 1 micro-batches, `alternative` also evaluates the layout under the
    other accumulation option (Workload.zero2_accumulate), so both costs can be shown.
    """
    state = model_state(model, workload, layout)
    est = Estimate(layout, state, capacity_bytes=cluster.gpu_memory_bytes)
    est.peak_flops = cluster.mfu_peak_flops
    if layout.zero == 2:
        est.zero2_accumulate = workload.zero2_accumulate
    est.problems = shape_problems(model, cluster, layout) + compress_problems(workload, layout)
    est.problems += diloco_problems(workload, layout)
    est.redundant_bytes = memory.redundant_bytes(model.params, workload, layout, state)
    try:
        k = microbatches_for(workload, layout)
        traffic = diloco_traffic if workload.sync_every else compressed_traffic
        est.comm = traffic(model, workload, layout, cluster, k)
    except ValueError as e:
        est.problems.append(str(e))
        return est
    if layout.cp > 1 and model.has_shape:
        est.comm += context.cp_traffic(model, workload, layout, cluster, k)
    est.comm += ep_traffic(model, workload, layout, cluster, k)
    est.model_state = state = model_state(model, workload, layout, k)
    est.microbatches, est.global_batch = k, k * workload.micro_batch * layout.dp
    est.activation_bytes = activations.activation_bytes(model, workload, layout, k)
    if est.activation_bytes is not None and model.has_shape:
        est.activation_bytes += context.ring_buffer_bytes(model, workload, layout)
    est.bubble = pipeline.bubble_fraction(layout.pp, k, layout.chunks, layout.schedule)
    _time_step(est, model, cluster, workload, layout, k)
    if est.memory_bytes > cluster.gpu_memory_bytes:
        est.problems.append(_too_big(est, state, cluster))
    if alternative and layout.zero == 2 and layout.data_ranks > 1 and k > 1:
        other = "shard" if workload.zero2_accumulate == "full" else "full"
        other_workload = replace(workload, zero2_accumulate=other)
        est.alternative = estimate(model, cluster, other_workload, layout, alternative=False)
    return est


def _time_step(
    est: Estimate,
    model: ModelSpec,
    cluster: ClusterSpec,
    workload: Workload,
    layout: Layout,
    k: int,
) -> None:
    """The step's FLOPs, busy time, bubble and exposed communication over k micro-batches,
    into `est`."""
    tokens = k * workload.micro_batch * layout.dp * (model.seq_len or 0)  # est.global_batch
    est.model_flops = ptime.model_training_flops(model, tokens, workload.recompute)
    busiest = ptime.model_training_flops(model, tokens, workload.recompute, workload.moe_imbalance)
    busy = stage_time.busy_time(model, workload, layout, cluster, k, busiest)
    bubble_s = pipeline.bubble_time(busy.total_s, layout.pp, k, layout.chunks, layout.schedule)
    # DP traffic can hide only behind the backward still running: the last micro-batch's.
    window_s = busy.total_s / k * stage_time.backward_share(workload.recompute)
    hidden_s = (
        context.ring_hidden_s(model, workload, layout, cluster, k) if model.has_shape else 0.0
    )
    est.time = ptime.step_time(
        busy.total_s, bubble_s, est.comm, cluster, workload.overlap, window_s, busy.memory_s,
        hidden_s,
    )  # fmt: skip
    if tokens:
        est.train_time_s = est.time.total_s * workload.train_tokens / tokens


def _too_big(est: Estimate, state: memory.ModelState, cluster: ClusterSpec) -> str:
    """Why the layout does not fit one GPU, item by item."""
    whole = state.grad_accumulation
    return (
        f"needs {est.memory_bytes / GB:.2f} GB per GPU ({state.step_boundary / GB:.2f} "
        "model state"
        + (f" + {whole / GB:.2f} whole gradient accumulated" if whole else "")
        + (f" + {est.activation_bytes / GB:.2f} activations" if est.activation_bytes else "")
        + f") of {cluster.gpu_memory_bytes / GB:.0f} GB"
    )
