"""The planner: pure functions from model, cluster, workload and layout to predictions.

No process groups and no tensors: dataclasses in, dataclasses out (ARCHITECTURE.md). Data
flows: model.py and cluster.py (specs and presets) and layout.py (a candidate and the batch
arithmetic) -> the formulas memory.py, activations.py, comm.py, pipeline.py, time.py ->
estimate.py (one layout, the busiest GPU) -> recommend.py (search and the seeds' rule) ->
summary.py, report.py and chart.py (what is shown); `paratrain plan`'s flags and run are
commands/plan_flags.py and commands/plan_run.py. rank_memory.py and rank_traffic.py count every
rank of our own runtime exactly, for `plan --validate` and `paratrain train`'s prediction.
stage_time.py times the busiest GPU (matmuls at the calibrated efficiency, pointwise ops at
memory bandwidth); published.py holds published runs as data and published_check.py
predicts them (`plan --published`). context.py adds context parallelism (cp's key/value
or all-to-all traffic and the ring's overlap), moe.py a mixture of experts (parameters,
active FLOPs, imbalance) and expert_traffic.py its all-to-alls. Formulas and sources:
docs/planner.md.
"""

from paratrain.plan.cluster import CLUSTER_PRESETS, ClusterSpec, cluster_preset
from paratrain.plan.estimate import Estimate, estimate
from paratrain.plan.layout import PRECISIONS, Layout, Precision, Workload
from paratrain.plan.model import MODEL_PRESETS, ModelSpec, model_preset
from paratrain.plan.recommend import Plan, plan

__all__ = [
    "CLUSTER_PRESETS",
    "MODEL_PRESETS",
    "PRECISIONS",
    "ClusterSpec",
    "Estimate",
    "Layout",
    "ModelSpec",
    "Plan",
    "Precision",
    "Workload",
    "cluster_preset",
    "estimate",
    "model_preset",
    "plan",
]
