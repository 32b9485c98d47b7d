"""What the planner knows about a cluster: nodes of GPUs, two kinds of link, FLOP/s.

Bandwidths are per GPU and per direction, the figure a ring collective is limited by.
Each preset's name carries its figures so a table never hides an assumption.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

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

    def __post_init__(self) -> None:
        positive = ("gpus", "gpus_per_node", "gpu_memory_bytes", "intra_bw", "inter_bw")
        for name in (*positive, "peak_flops"):
            if getattr(self, name) <= 0:
                raise ValueError(
                    f"cluster {self.name}: {name} = {getattr(self, name)}; must be > 0"
                )
        for name in ("intra_latency_s", "inter_latency_s"):
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
    def nodes(self) -> int:
        return max(1, self.gpus // self.gpus_per_node)


# A100 SXM 80GB: NVLink 3 is 600 GB/s both directions = 300 GB/s per direction; DGX A100
# has one 200 Gb/s HDR port per GPU = 25 GB/s; 312 TFLOP/s dense bf16 (NVIDIA A100
# datasheet). H100 SXM: NVLink 4 is 900 GB/s both directions = 450 per direction; DGX H100
# has one 400 Gb/s NDR port per GPU = 50 GB/s; 989 TFLOP/s dense bf16 (H100 datasheet).
# Latencies are assumptions of the usual order (a few microseconds per message).
# Utilisation 0.5 is the order of model FLOP/s utilisation that Megatron-LM reports at
# scale (arXiv:2104.04473, 52% of peak for 1T parameters on A100).
CLUSTER_PRESETS: dict[str, ClusterSpec] = {
    "a100-80gb-nvlink300-ib25": ClusterSpec(
        "a100-80gb-nvlink300-ib25", 8, 8, 80 * GB, 300 * GB, 25 * GB, 5e-6, 10e-6, 312e12, 0.5
    ),
    "h100-80gb-nvlink450-ib50": ClusterSpec(
        "h100-80gb-nvlink450-ib50", 8, 8, 80 * GB, 450 * GB, 50 * GB, 5e-6, 10e-6, 989e12, 0.5
    ),
    # The seeds' figures (example 9.2.2): NVLink 300 GB/s per direction, InfiniBand 400 Gb/s
    # = 50 GB/s, 1e14 FLOP/s effective per GPU (so utilisation 1 of a 1e14 "peak").
    "seeds-80gb-nvlink300-ib50-1e14": ClusterSpec(
        "seeds-80gb-nvlink300-ib50-1e14", 8, 8, 80 * GB, 300 * GB, 50 * GB, 5e-6, 10e-6, 1e14, 1.0
    ),
}
DEFAULT_CLUSTER = "seeds-80gb-nvlink300-ib50-1e14"


def cluster_preset(name: str) -> ClusterSpec:
    if name not in CLUSTER_PRESETS:
        raise ValueError(f"unknown cluster preset {name!r}; valid: {', '.join(CLUSTER_PRESETS)}")
    return CLUSTER_PRESETS[name]


def cluster_with(spec: ClusterSpec, **changes: float | None) -> ClusterSpec:
    """The spec with every non-None change applied; `gpus` defaults to one node."""
    given = {k: v for k, v in changes.items() if v is not None}
    if "gpus_per_node" in given and "gpus" not in given:
        given["gpus"] = given["gpus_per_node"]
    return replace(spec, **given) if given else spec
