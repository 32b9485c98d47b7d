"""A run configuration as the planner's inputs: the one conversion, used by `paratrain
train`'s prediction (train/prediction.py) and by `plan --validate`'s cases (bench/planner/).

The planner models a subset of what the runtime runs; what it approximates is returned as
notes, printed beside the prediction.
"""

from __future__ import annotations

from paratrain.config import RunConfig
from paratrain.config.resolution import muon_ns_dtype
from paratrain.models.plans import PLANS, lora_patterns
from paratrain.plan.layout import ONE_BUCKET, PRECISIONS, SCHEDULES, Layout, LoraSpec, Workload
from paratrain.plan.model import ModelSpec
from paratrain.plan.rank_experts import run_model

MUON_NS_BYTES = {"bfloat16": 2, "float32": 4}  # config.choices.MUON_NS_DTYPES
LORA_NOTE = "LoRA: tp traffic predicted as a full fine-tune's (less is sent)"
LORA_OTHER_NOTE = "LoRA on targets other than the model plan's patterns: predicted as full training"
EP_NOTE = (
    "ep: the token all-to-all is predicted for a balanced router, 2 k N d e (ep-1)/ep per "
    "layer and pass; the run's routing moves more or less"
)


def planner_inputs(cfg: RunConfig) -> tuple[ModelSpec, Workload, Layout, list[str]]:
    """The run's model, workload and layout as the planner takes them, and any caveats."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    model, experts = run_model(m, t.seq_len)
    muon = t.optimizer == "muon"
    workload = Workload(
        micro_batch=t.micro_batch,
        global_batch=t.global_batch,
        precision=PRECISIONS["fp32" if t.dtype == "float32" else "mixed"],
        recompute=t.recompute,
        bucket_bytes=int(p.bucket_mb * 2**20) or ONE_BUCKET,
        zero2_accumulate=p.zero2_accumulate,
        prefetch=p.prefetch,
        # Muon over whole matrices or ZeRO's shards (plan/muon.py, plan/muon_shards.py)
        muon_ns_bytes=MUON_NS_BYTES[muon_ns_dtype(t.muon_ns_dtype, p.device)] if muon else 0,
        muon_ns_steps=t.muon_ns_steps,
        optimizer="sgd" if t.optimizer == "sgd" else "adam",
        lora=lora_spec(cfg),
        compress=p.compress,
        compress_rank=p.compress_rank,
        compress_idle=t.steps <= p.compress_start,  # the last step (index steps - 1) exact
    )
    notes = []
    if t.lora_rank:
        notes.append(LORA_NOTE if workload.lora else LORA_OTHER_NOTE)
    if experts is not None:  # the dense model of the same shape; rank_experts.py adds them
        notes.append("experts: activations counted as the dense model's")
        if p.ep > 1:
            notes.append(EP_NOTE)
    schedule = p.schedule if p.pp > 1 else ""
    if schedule and schedule not in SCHEDULES:  # a runtime schedule the planner lacks
        notes.append(f"{schedule}: traffic and memory as 1f1b, bubble not modelled")
        schedule = "1f1b"
    layout = Layout(
        dp=p.dp,
        tp=p.tp,
        pp=p.pp,
        zero=p.zero,
        schedule=schedule,
        chunks=p.chunks,
        cp=p.cp,
        cp_method=p.cp_method,
        ep=p.ep,
        replicas=p.replicas,
        sequence_parallel=p.sequence_parallel,
    )
    return model, workload, layout, notes


def lora_spec(cfg: RunConfig) -> LoraSpec | None:
    """The run's adapters as the planner counts them: the model plan's `lora_targets` that
    --lora-targets names; None without LoRA, or when it names other patterns (LORA_NOTE)."""
    t, plan = cfg.train, PLANS[cfg.model.arch]
    given = lora_patterns(t.lora_targets, plan)
    if not t.lora_rank or any(g not in plan.lora_targets for g in given):
        return None
    return LoraSpec(t.lora_rank, tuple(i for i, g in enumerate(plan.lora_targets) if g in given))
