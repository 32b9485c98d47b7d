"""Published training runs, as data: each run's model, layout and workload, the cluster
preset it ran on, and the TFLOP/s per GPU its authors published, with the source.

Only figures found in the sources named here. Micro-batch sizes, virtual pipeline
chunks, recomputation and the data-parallel implementation of Narayanan et al.'s Table 1
come from the authors' own scripts for that table (NVIDIA/Megatron-LM,
examples/sc21/run_table_1.sh and CONFIG.sh, commit de7dc40f "scripts for sc21"); the
paper's section 5.1 says the interleaved schedule with the scatter/gather optimisation.
`overlap` is what the run's data-parallel code does, not a fitted number: PyTorch DDP
(`--DDP-impl torch`) all-reduces gradient buckets while the backward runs (1: as much as
the last micro-batch's backward can hide); Megatron's local DDP and DeepSpeed's pipeline
engine all-reduce after the step (0).
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.plan.cluster import ClusterSpec, cluster_preset, cluster_with
from paratrain.plan.layout import PRECISIONS, Layout, Workload
from paratrain.plan.model import ModelSpec

NARAYANAN = (
    "Narayanan et al. 2021, arXiv:2104.04473, Table 1 (weak scaling on Selene, A100 80 GB); "
    "layouts: NVIDIA/Megatron-LM examples/sc21/run_table_1.sh"
)
BLOOM = (
    "BLOOM 176B (BigScience): ~150 TFLOP/s per GPU, bigscience.notion.site "
    "BigScience-176B-Model; layout: bigscience-workshop/bigscience "
    "train/tr11-176B-ml/tr11-176B-ml.slurm; hardware: arXiv:2211.05100"
)


@dataclass(frozen=True)
class PublishedRun:
    name: str
    source: str
    cluster: str  # a plan/cluster.py preset
    gpus: int
    n_layer: int
    d_model: int
    n_head: int
    vocab_size: int
    seq_len: int
    tp: int
    pp: int
    global_batch: int
    micro_batch: int
    # published model TFLOP/s per GPU (eq. 3 of Narayanan et al.); None: only the ordering
    # of a figure is used (LAYOUT_COMPARISONS)
    tflops_per_gpu: float | None = None
    chunks: int = 1
    schedule: str = "interleaved"  # when pp > 1
    zero: int = 0
    recompute: str = "full"
    attention: str = "scores"
    pp_scatter_gather: bool = True
    overlap: float = 0.0

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    def model(self) -> ModelSpec:
        shape = (self.n_layer, self.d_model, self.n_head, self.vocab_size, self.seq_len)
        return ModelSpec(self.name, None, *shape)

    def layout(self) -> Layout:
        schedule = self.schedule if self.pp > 1 else ""
        if schedule == "interleaved" and self.chunks == 1:
            schedule = "1f1b"  # one chunk per GPU: the interleaved schedule is 1F1B
        return Layout(self.dp, self.tp, self.pp, self.zero, schedule, self.chunks)

    def workload(self) -> Workload:
        return Workload(
            micro_batch=self.micro_batch,
            global_batch=self.global_batch,
            precision=PRECISIONS["mixed"],
            recompute=self.recompute,
            overlap=self.overlap,
            pp_scatter_gather=self.pp_scatter_gather,
            attention=self.attention,
        )

    def cluster_spec(self, efficiency: float | None = None) -> ClusterSpec:
        return cluster_with(cluster_preset(self.cluster), gpus=self.gpus, utilisation=efficiency)


def _table_1(
    name: str, shape: tuple[int, int, int], tp: int, pp: int, gpus: int, batch: int, **run: float
) -> PublishedRun:
    """One row of Table 1: (heads, hidden, layers), tp, pp, GPUs, global batch; `run` adds
    micro_batch, chunks, overlap (from run_table_1.sh) and the published tflops_per_gpu."""
    heads, hidden, layers = shape
    return PublishedRun(
        name=name,
        source=NARAYANAN,
        cluster="a100-80gb-nvlink300-ib25",
        gpus=gpus,
        n_layer=layers,
        d_model=hidden,
        n_head=heads,
        vocab_size=51200,
        seq_len=2048,
        tp=tp,
        pp=pp,
        global_batch=batch,
        **run,  # type: ignore[arg-type]  # micro_batch and chunks: ints in every row
    )


# chunks = layers per stage / --num-layers-per-virtual-pipeline-stage; overlap 1 where the
# script says --DDP-impl torch. TFLOP/s per GPU as the paper's Table 1 publishes them.
NARAYANAN_TABLE_1: tuple[PublishedRun, ...] = (
    _table_1("1.7B", (24, 2304, 24), 1, 1, 32, 512, micro_batch=16, overlap=1, tflops_per_gpu=137),
    _table_1("3.6B", (32, 3072, 30), 2, 1, 64, 512, micro_batch=16, overlap=1, tflops_per_gpu=138),
    _table_1("7.5B", (32, 4096, 36), 4, 1, 128, 512, micro_batch=16, overlap=1, tflops_per_gpu=142),
    _table_1(
        "18.4B", (48, 6144, 40), 8, 1, 256, 1024, micro_batch=8, overlap=1, tflops_per_gpu=135
    ),
    _table_1("39.1B", (64, 8192, 48), 8, 2, 512, 1536, micro_batch=4, tflops_per_gpu=138),
    _table_1(
        "76.1B", (80, 10240, 60), 8, 4, 1024, 1792, micro_batch=2, chunks=3, tflops_per_gpu=140
    ),
    _table_1(
        "145.6B", (96, 12288, 80), 8, 8, 1536, 2304, micro_batch=2, chunks=2, tflops_per_gpu=148
    ),
    _table_1(
        "310.1B", (128, 16384, 96), 8, 16, 1920, 2160, micro_batch=1, chunks=2, tflops_per_gpu=155
    ),
    _table_1(
        "529.6B", (128, 20480, 105), 8, 35, 2520, 2520, micro_batch=1, chunks=3, tflops_per_gpu=163
    ),
    _table_1("1008B", (160, 25600, 128), 8, 64, 3072, 3072, micro_batch=1, tflops_per_gpu=163),
)

# BLOOM on Jean Zay: Megatron-DeepSpeed, bf16 with DeepSpeed's ZeRO-1-like bf16 optimizer,
# --checkpoint-activations, DeepSpeed's 1F1B pipeline (no interleaving, whole messages);
# 70 layers cut with the embeddings as units (72 / 12 = 6 per stage), which the planner's
# even cut of 70 over 12 approximates; vocabulary padded to 250,880.
BLOOM_176B = PublishedRun(
    name="BLOOM-176B",
    source=BLOOM,
    cluster="a100-80gb-nvlink300-ib6-omnipath",
    gpus=384,
    n_layer=70,
    d_model=14336,
    n_head=112,
    vocab_size=250880,
    seq_len=2048,
    tp=4,
    pp=12,
    global_batch=2048,
    micro_batch=2,
    tflops_per_gpu=150,
    schedule="1f1b",
    zero=1,
    pp_scatter_gather=False,
)

PUBLISHED_RUNS: tuple[PublishedRun, ...] = (*NARAYANAN_TABLE_1, BLOOM_176B)
# The single run per hardware that its efficiency is fitted on (plan/cluster.py).
CALIBRATION_RUNS = {"A100": NARAYANAN_TABLE_1[0]}


@dataclass(frozen=True)
class LayoutComparison:
    """Layouts of one workload whose published order the planner must reproduce."""

    name: str
    claim: str  # what the source reports
    runs: tuple[PublishedRun, ...]
    published_order: tuple[str, ...]  # layout labels, fastest first (a prefix may suffice)


FIGURES = (
    "Narayanan et al. 2021, arXiv:2104.04473, section 5.4, Figures 13-15; layouts: "
    "NVIDIA/Megatron-LM examples/sc21/run_figure_13.sh, _14.sh, _15.sh"
)


def _figure_run(
    name: str, shape: tuple[int, int, int], tp: int, pp: int, batch: int
) -> PublishedRun:
    """64 GPUs, micro-batch 1, full recomputation, Megatron's local DDP, 1F1B."""
    heads, hidden, layers = shape
    return PublishedRun(
        name, FIGURES, "a100-80gb-nvlink300-ib25", 64, layers, hidden, heads, 51200, 2048,
        tp, pp, batch, micro_batch=1, schedule="1f1b",
    )  # fmt: skip


def _sweep(
    name: str, shape: tuple[int, int, int], pairs: list[tuple[int, int]], batch: int
) -> tuple[PublishedRun, ...]:
    return tuple(_figure_run(name, shape, tp, pp, batch) for tp, pp in pairs)


GPT_162B = (128, 20480, 32)  # Figure 13's model: heads, hidden, layers
GPT_5_9B = (32, 3840, 32)  # Figures 14 and 15
LAYOUT_COMPARISONS: tuple[LayoutComparison, ...] = (
    LayoutComparison(
        "Figure 13: 162.2B on 64 GPUs, (pp, tp) from (2, 32) to (32, 2), G = 128",
        "fastest where tp is the GPUs per node, tp 8 x pp 8",
        _sweep("162.2B", GPT_162B, [(32, 2), (16, 4), (8, 8), (4, 16), (2, 32)], 128),
        ("tp8.pp8.dp1.z0.1f1b",),
    ),
    LayoutComparison(
        "Figure 14: 5.9B on 64 GPUs, pp from 2 to 32, the rest data parallel, G = 512",
        "throughput falls as pp grows",
        _sweep("5.9B", GPT_5_9B, [(1, 2), (1, 4), (1, 8), (1, 16), (1, 32)], 512),
        tuple(f"tp1.pp{p}.dp{64 // p}.z0.1f1b" for p in (2, 4, 8, 16, 32)),
    ),
    LayoutComparison(
        "Figure 15: 5.9B on 64 GPUs, tp from 2 to 32, the rest data parallel, G = 512",
        "throughput falls as tp grows",
        _sweep("5.9B", GPT_5_9B, [(2, 1), (4, 1), (8, 1), (16, 1), (32, 1)], 512),
        tuple(f"tp{t}.pp1.dp{64 // t}.z0" for t in (2, 4, 8, 16, 32)),
    ),
)
