"""What the planner knows about a cluster: nodes of GPUs, two kinds of link, FLOP/s.

Bandwidths are per GPU and per direction, the figure a ring collective is limited by.
Each preset's name carries its figures so a table never hides an assumption.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

GB = 1e9  # the seeds count memory and bandwidth in decimal gigabytes


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    gpus: int  # GPUs in the job
    gpus_per_node: int
    gpu_memory_bytes: float
    intra_bw: float  # bytes/s per GPU per direction inside a node (NVLink)
    inter_bw: float  # bytes/s per GPU per direction between nodes (InfiniBand)
    intra_latency_s: float  # alpha of one message inside a node
    inter_latency_s: float  # alpha of one message between nodes
    peak_flops: float  # per GPU, dense, in the training precision
    utilisation: float  # fraction of peak_flops reached by the model's matmuls
    # HBM bytes/s per GPU: pointwise ops (norms, GELU, softmax, dropout, residual adds) are
    # memory-bound and timed at this bandwidth (plan/stage_time.py); 0: not counted.
    memory_bw: float = 0.0
    # The GPU's datasheet peak, the denominator of MFU, where peak_flops is not it (the
    # seeds' 1e14 is an effective rate, not a datasheet figure); 0: peak_flops is.
    datasheet_flops: float = 0.0

    def __post_init__(self) -> None:
        positive = ("gpus", "gpus_per_node", "gpu_memory_bytes", "intra_bw", "inter_bw")
        for name in (*positive, "peak_flops"):
            if getattr(self, name) <= 0:
                raise ValueError(
                    f"cluster {self.name}: {name} = {getattr(self, name)}; must be > 0"
                )
        for name in ("intra_latency_s", "inter_latency_s", "memory_bw"):
            if getattr(self, name) < 0:
                raise ValueError(
                    f"cluster {self.name}: {name} = {getattr(self, name)}; must be >= 0"
                )
        if not 0 < self.utilisation <= 1:
            raise ValueError(
                f"cluster {self.name}: utilisation = {self.utilisation}; valid: 0 < u <= 1"
            )
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise ValueError(
                f"cluster {self.name}: {self.gpus} GPUs is not a whole number of nodes of "
                f"{self.gpus_per_node}"
            )

    @property
    def effective_flops(self) -> float:
        return self.peak_flops * self.utilisation

    @property
    def mfu_peak_flops(self) -> float:
        """What MFU divides by: the datasheet peak per GPU."""
        return self.datasheet_flops or self.peak_flops

    @property
    def efficiency(self) -> float:
        """The fraction of the datasheet peak the matmuls are taken to reach."""
        return self.effective_flops / self.mfu_peak_flops

    @property
    def nodes(self) -> int:
        return max(1, self.gpus // self.gpus_per_node)


# A100 SXM 80GB: NVLink 3 is 600 GB/s both directions = 300 GB/s per direction; DGX A100
# has one 200 Gb/s HDR port per GPU (8 x 200 Gb/s per node) = 25 GB/s; 312 TFLOP/s dense
# bf16/fp16; HBM2e 2,039 GB/s (NVIDIA A100 datasheet). That is the cluster of Narayanan et
# al. 2021 (arXiv:2104.04473, Selene: DGX A100 80 GB nodes). H100 SXM: NVLink 4 is 900 GB/s
# both directions = 450 per direction; DGX H100 has one 400 Gb/s NDR port per GPU = 50 GB/s;
# 989 TFLOP/s dense bf16; HBM3 3,350 GB/s (H100 datasheet). Latencies are assumptions of
# the usual order (a few microseconds per message).
#
# A100_EFFICIENCY: the fraction of peak the matmuls reach, fitted on ONE published run, the
# 1.7B row of Narayanan et al.'s Table 1 (tp 1, pp 1, dp 32: no tensor or pipeline traffic
# and no bubble, so compute alone sets its step): the value at which `paratrain plan`
# predicts that run's published 137 TFLOP/s per GPU (plan/published_check.py
# `fit_efficiency`, bisection; tests/test_plan_published.py refits it). Every other
# published row is then a prediction (docs/planner.md, `paratrain plan --published`).
A100_EFFICIENCY = 0.6436
A100_PEAK_FLOPS = 312e12  # dense bf16, the A100 datasheet
# No published H100 run with its whole layout (micro-batch, chunks, recomputation) was
# found to fit on, so the H100 keeps the order of magnitude of Megatron-LM's reported MFU
# (41-48% on H100, Megatron-LM README): assumed, not calibrated.
H100_EFFICIENCY = 0.5
CLUSTER_PRESETS: dict[str, ClusterSpec] = {
    "a100-80gb-nvlink300-ib25": ClusterSpec(
        "a100-80gb-nvlink300-ib25",
        *(8, 8, 80 * GB, 300 * GB, 25 * GB, 5e-6, 10e-6, A100_PEAK_FLOPS),
        utilisation=A100_EFFICIENCY,
        memory_bw=2039 * GB,
    ),
    # BLOOM's Jean Zay partition (arXiv:2211.05100, hardware): 8 A100 80 GB per node, 4
    # Omni-Path 100 Gb/s links per node = 50 GB/s per node, 6.25 per GPU ("ib" in the name
    # is the inter-node link, Omni-Path here). The same GPU, so the same efficiency.
    "a100-80gb-nvlink300-ib6-omnipath": ClusterSpec(
        "a100-80gb-nvlink300-ib6-omnipath",
        *(8, 8, 80 * GB, 300 * GB, 6.25 * GB, 5e-6, 10e-6, A100_PEAK_FLOPS),
        utilisation=A100_EFFICIENCY,
        memory_bw=2039 * GB,
    ),
    "h100-80gb-nvlink450-ib50": ClusterSpec(
        "h100-80gb-nvlink450-ib50",
        *(8, 8, 80 * GB, 450 * GB, 50 * GB, 5e-6, 10e-6, 989e12),
        utilisation=H100_EFFICIENCY,
        memory_bw=3350 * GB,
    ),
    # The seeds' figures (example 9.2.2): NVLink 300 GB/s per direction, InfiniBand 400 Gb/s
    # = 50 GB/s, 1e14 FLOP/s effective per GPU (so utilisation 1 of a 1e14 "peak"); no
    # memory bandwidth, so their worked examples reproduce. The hardware is an A100 80 GB
    # (80 GB, NVLink 300): MFU is against its 312 TFLOP/s, so the 1e14 reads as 32%.
    "seeds-80gb-nvlink300-ib50-1e14": ClusterSpec(
        "seeds-80gb-nvlink300-ib50-1e14",
        *(8, 8, 80 * GB, 300 * GB, 50 * GB, 5e-6, 10e-6, 1e14, 1.0),
        datasheet_flops=A100_PEAK_FLOPS,
    ),
}
# One line each for `plan --help` and the table: what hardware, and where its figures are from.
CLUSTER_DESCRIPTIONS = {
    "a100-80gb-nvlink300-ib25": "DGX A100 80 GB nodes (Megatron-LM's Selene), "
    "312 TFLOP/s bf16 peak, efficiency 64% fitted on one published run",
    "a100-80gb-nvlink300-ib6-omnipath": "BLOOM's Jean Zay A100 80 GB nodes, "
    "6.25 GB/s per GPU between nodes, efficiency as a100",
    "h100-80gb-nvlink450-ib50": "DGX H100 nodes, 989 TFLOP/s bf16 peak, efficiency 50% assumed",
    "seeds-80gb-nvlink300-ib50-1e14": "the seeds' textbook cluster: A100-class 80 GB GPUs at "
    "1e14 FLOP/s effective (32% of the 312 TFLOP/s peak), no memory-bandwidth term",
}
DEFAULT_CLUSTER = "seeds-80gb-nvlink300-ib50-1e14"


def cluster_preset(name: str) -> ClusterSpec:
    if name not in CLUSTER_PRESETS:
        raise ValueError(f"unknown cluster preset {name!r}; valid: {', '.join(CLUSTER_PRESETS)}")
    return CLUSTER_PRESETS[name]


def cluster_with(spec: ClusterSpec, **changes: float | None) -> ClusterSpec:
    """The spec with every non-None change applied; `gpus` defaults to one node."""
    # Each value of its field's type (the CLI's flags); replace checks the names.
    given: dict[str, Any] = {k: v for k, v in changes.items() if v is not None}
    if "peak_flops" in given and "datasheet_flops" not in given:
        given["datasheet_flops"] = 0.0  # a peak given by flag is the datasheet's
    if "gpus_per_node" in given and "gpus" not in given:
        given["gpus"] = given["gpus_per_node"]
    return replace(spec, **given) if given else spec
