"""The planner: pure functions from model, cluster, workload and layout to predictions.

No process groups and no tensors: dataclasses in, dataclasses out (ARCHITECTURE.md). One
concept per module: model.py and cluster.py (specs and presets), layout.py (a candidate
and the batch arithmetic), memory.py, comm.py, pipeline.py, time.py (the formulas),
estimate.py (one layout), recommend.py (search and the seeds' rule), ranks.py and
rank_traffic.py (every rank of our own runtime, exactly: what it holds and sends),
report.py (table and chart), command.py (`paratrain plan`). Formulas and sources:
docs/planner.md.

How data flows: command.py turns flags and presets into a ModelSpec, a ClusterSpec and a
Workload; recommend.py enumerates Layouts and estimate.py runs the formulas on each, into
an Estimate; the Plan (recommend.py) ranks them and report.py prints and draws it. The
per-rank modules serve `plan --validate` (its measured runs are bench/planner/, which the
CLI hands to command.py) and `paratrain train`'s prediction line. Nothing here imports
bench/ or train/.
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
