"""The planner: pure functions from model, cluster, workload and layout to predictions.

No process groups and no tensors: dataclasses in, dataclasses out (ARCHITECTURE.md). One
concept per module: model.py and cluster.py (specs and presets), layout.py (a candidate
and the batch arithmetic), memory.py, comm.py, pipeline.py, time.py (the formulas),
estimate.py (one layout), recommend.py (search and the seeds' rule), report.py (table and
chart), command.py (`paratrain plan`). Formulas and sources: docs/planner.md.
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
