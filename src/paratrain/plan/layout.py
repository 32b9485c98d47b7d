"""A candidate layout (tp x cp x pp x dp, ep, ZeRO stage, schedule) and the workload it runs.

Batch arithmetic is the project's one definition (ARCHITECTURE.md): G sequences per step,
b per micro-batch, K = G / (b * dp) micro-batches per replica per step, which is both the
gradient-accumulation count and the pipeline's micro-batch count (seeds, definition 9.2.2:
B_global = K * B_micro * k). Context parallelism does not enter it: the cp ranks of a
data-parallel replica hold chunks of the same sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.config import RECOMPUTE_MODES
from paratrain.config import SCHEDULES as SCHEDULES  # re-exported: the planner's vocabulary
from paratrain.config import ZERO2_ACCUMULATE as ZERO2_ACCUMULATE

# The runtime's modes, counted as the runtime runs them ("selective" is its op-level policy,
# parallel/recompute.py, not Korthikanti et al.'s attention-core variant).
RECOMPUTE = RECOMPUTE_MODES
ATTENTION = ("fused", "scores")  # s x s scores kept on chip or through memory, as memory.py
CP_METHODS = ("ring", "alltoall")  # parallel/context_parallel: ring.py, ulysses.py


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each model-state kind, and of one activation element.

    ZeRO (arXiv:1910.02054, section 3.1) counts mixed-precision Adam as 2 + 2 + K with
    K = 12: fp32 master weights (4) and the two fp32 moments (4 + 4).
    """

    name: str
    param_bytes: int
    grad_bytes: int
    moment_bytes: int  # bytes of one optimizer moment per parameter
    master_bytes: int  # fp32 copy of the weights; 0 when the weights are already fp32
    activation_bytes: int  # one stored activation element


PRECISIONS: dict[str, Precision] = {
    "mixed": Precision("mixed", 2, 2, 4, 4, 2),  # bf16/fp16 compute, fp32 master + moments
    "fp32": Precision("fp32", 4, 4, 4, 0, 4),
    "bf16": Precision("bf16", 2, 2, 2, 0, 2),  # pure bf16, moments in bf16 too
}
OPTIMIZER_MOMENTS = {"adam": 2, "sgd-momentum": 1, "sgd": 0}


def precision(name: str) -> Precision:
    if name not in PRECISIONS:
        raise ValueError(f"unknown precision {name!r}; valid: {', '.join(PRECISIONS)}")
    return PRECISIONS[name]


def optimizer_moments(name: str) -> int:
    if name not in OPTIMIZER_MOMENTS:
        raise ValueError(f"unknown optimizer {name!r}; valid: {', '.join(OPTIMIZER_MOMENTS)}")
    return OPTIMIZER_MOMENTS[name]


@dataclass(frozen=True)
class LoraSpec:
    """LoRA's adapters (plan/lora.py): rank r, and which of a block's matrices carry them,
    as indices into plan/muon.py's `block_matrices` (a model plan's `lora_targets`)."""

    rank: int
    targets: tuple[int, ...]


ONE_BUCKET = 2**62  # Workload.bucket_bytes of --bucket-mb 0: larger than any gradient


@dataclass(frozen=True)
class Workload:
    """How the model is trained, independent of the layout."""

    micro_batch: int = 1  # b, sequences per forward pass
    global_batch: int | None = 512  # G; None: derived per layout from `microbatches`
    microbatches: int | None = None  # K; None: derived per layout from G
    precision: Precision = PRECISIONS["mixed"]
    optimizer: str = "adam"
    recompute: str = "none"
    activation_bytes_override: float | None = None  # per GPU, replaces the count
    overlap: float = 0.0  # fraction of data-parallel traffic hidden behind backward
    bucket_bytes: int = 25 * 2**20  # gradient bucket (PyTorch DDP's 25 MiB default)
    # ONE_BUCKET: --bucket-mb 0, the whole gradient in one bucket
    train_tokens: float = 300e9  # for the total training time (GPT-3 trained on 300B)
    # ZeRO-2 with K > 1 micro-batches: "shard" reduce-scatters after every micro-batch into
    # the shard (the runtime's default, DeepSpeed's ZeRO-2: model state 2N + 14N/k with
    # mixed Adam); "full" holds the whole gradient until the last one and reduce-scatters
    # once. See comm.py and memory.py.
    zero2_accumulate: str = "shard"
    # ZeRO-3: units gathered ahead of the one computing (--prefetch; data_parallel/fsdp.py),
    # each one more unit of whole parameters at the peak (rank_peak.py)
    prefetch: int = 1
    # Megatron's scatter/gather (arXiv:2104.04473, section 4.1): each tp rank sends 1/t of
    # a pipeline message across nodes and the receivers all-gather it over NVLink. Our
    # runtime sends the whole b s h tensor (False).
    pp_scatter_gather: bool = False
    # "fused": attention never writes the s x s scores to memory (our runtime's SDPA);
    # "scores": scores, softmax and dropout mask go through HBM (Megatron-LM in 2021).
    attention: str = "fused"
    # The router's load imbalance: tokens routed to the busiest expert-parallel rank over
    # the mean, >= 1 (1: uniform routing). A capacity factor caps it (plan/moe.py).
    moe_imbalance: float = 1.0
    # --optimizer muon (plan/muon.py): the bytes per element of its Newton-Schulz precision
    # (2 bfloat16, 4 float32), which its all-gather moves; 0: AdamW only.
    muon_ns_bytes: int = 0
    muon_ns_steps: int = 5  # Newton-Schulz iterations per matrix and step (FLOPs)
    # LoRA (plan/lora.py): the adapters' rank and targets; None: every parameter trains.
    lora: LoraSpec | None = None
    # --compress (plan/rank_compress.py): the gradients' codec, or "none" or "powersgd"
    compress: str = "none"
    compress_rank: int = 1  # PowerSGD's
    # the step predicted comes before --compress-start: reduced exactly, the state kept
    compress_idle: bool = False
    # --dp-mode diloco (plan/diloco_cost.py): H, steps between outer steps (0: synchronous)
    sync_every: int = 0
    outer_dtype: str = "float32"  # its pseudo-gradient on the wire

    def __post_init__(self) -> None:
        if self.micro_batch < 1:
            raise ValueError(f"micro-batch {self.micro_batch}; must be at least 1")
        if self.global_batch is None and self.microbatches is None:
            raise ValueError(
                "give a global batch (--global-batch) or micro-batches (--microbatches)"
            )
        if self.global_batch is not None and self.global_batch < 1:
            raise ValueError(f"global batch {self.global_batch}; must be at least 1")
        if self.microbatches is not None and self.microbatches < 1:
            raise ValueError(f"micro-batches {self.microbatches}; must be at least 1")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute {self.recompute!r}; valid: {', '.join(RECOMPUTE)}")
        optimizer_moments(self.optimizer)
        if not 0 <= self.overlap <= 1:
            raise ValueError(f"overlap {self.overlap}; valid: 0 <= overlap <= 1")
        if self.train_tokens <= 0:
            raise ValueError(f"train tokens {self.train_tokens}; must be > 0")
        if self.attention not in ATTENTION:
            raise ValueError(f"attention {self.attention!r}; valid: {', '.join(ATTENTION)}")
        if self.muon_ns_bytes not in (0, 2, 4):
            raise ValueError(f"Muon bytes per element {self.muon_ns_bytes}; valid: 0, 2, 4")
        if not self.moe_imbalance >= 1:
            raise ValueError(f"MoE imbalance {self.moe_imbalance}; must be >= 1 (1: uniform)")
        if self.zero2_accumulate not in ZERO2_ACCUMULATE:
            raise ValueError(
                f"zero2 accumulate {self.zero2_accumulate!r}; valid: {', '.join(ZERO2_ACCUMULATE)}"
            )

    @property
    def moments(self) -> int:
        return optimizer_moments(self.optimizer)

    @property
    def state_bytes_per_param(self) -> int:
        """16 for mixed-precision Adam: the seeds' 16N."""
        p = self.precision
        return p.param_bytes + p.grad_bytes + self.moments * p.moment_bytes + p.master_bytes


@dataclass(frozen=True)
class Layout:
    """One way to lay the job out: world = dp * pp * cp * tp, tp innermost (see mesh.py).

    cp ranks hold chunks of the same sequences and the same parameters, so gradients and
    ZeRO's shards span the dp_cp group of dp * cp ranks (Megatron-Core's distributed
    optimizer does the same). ep is carved out of those ranks (ep divides dp * cp): it
    splits the experts of a mixture-of-experts model and nothing else.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0  # ZeRO stage over the dp_cp group: 0 (plain DP), 1, 2, 3 (= FSDP)
    schedule: str = ""  # pipeline schedule when pp > 1
    chunks: int = 1  # v, model chunks per GPU for the interleaved schedule
    cp: int = 1  # context parallel: the sequence split over cp ranks
    cp_method: str = "ring"  # ring (keys and values travel) or alltoall (Ulysses)
    ep: int = 1  # expert parallel, within dp * cp
    # HSDP: ZeRO shards within each of `replicas` groups of the dp_cp ranks, the shards
    # all-reduced across them (parallel/data_parallel/hybrid.py)
    replicas: int = 1
    # Megatron's sequence parallelism (arXiv:2205.05198): the norms' and residuals' tokens
    # split over tp, gathered for the column-parallel layers
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "chunks", "cp", "ep", "replicas"):
            if getattr(self, name) < 1:
                raise ValueError(f"layout {name} = {getattr(self, name)}; must be at least 1")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence parallelism needs tp 2 or more")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage {self.zero}; valid: 0, 1, 2, 3")
        if self.pp > 1 and self.schedule not in SCHEDULES:
            raise ValueError(
                f"schedule {self.schedule!r} for pp={self.pp}; valid: {', '.join(SCHEDULES)}"
            )
        if self.chunks > 1 and self.schedule != "interleaved":
            raise ValueError(f"chunks {self.chunks} needs the interleaved schedule")
        if self.cp_method not in CP_METHODS:
            raise ValueError(f"cp method {self.cp_method!r}; valid: {', '.join(CP_METHODS)}")
        if self.data_ranks % self.ep:
            raise ValueError(f"ep {self.ep} does not divide dp {self.dp} x cp {self.cp}")
        if self.dp % self.replicas:
            raise ValueError(f"replicas {self.replicas} does not divide dp {self.dp}")
        if self.shard_ranks % self.ep:  # every replica group holds every expert
            raise ValueError(
                f"ep {self.ep} does not divide a replica group's {self.shard_ranks} ranks"
            )

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def data_ranks(self) -> int:
        """The dp_cp group: ranks with the same parameters and different tokens."""
        return self.dp * self.cp

    @property
    def shard_ranks(self) -> int:
        """The ranks ZeRO shards over: dp_cp, or under HSDP one replica group of it."""
        return self.data_ranks // self.replicas

    @property
    def label(self) -> str:
        """Short name for tables and charts, e.g. tp2.pp4.dp8.z1.1f1b, tp1.cp4.pp1.dp2.z0;
        cp and ep are named only when above 1, so 3D labels read as before."""
        cp = (
            ""
            if self.cp == 1
            else f".cp{self.cp}" + ("a2a" if self.cp_method == "alltoall" else "")
        )
        replicas = f"r{self.replicas}" if self.replicas > 1 else ""  # HSDP: dp8r2
        name = f"tp{self.tp}{cp}.pp{self.pp}.dp{self.dp}{replicas}.z{self.zero}"
        if self.pp > 1:
            name += "." + self.schedule + (f"x{self.chunks}" if self.chunks > 1 else "")
        return name + (f".ep{self.ep}" if self.ep > 1 else "")


def microbatches_for(workload: Workload, layout: Layout) -> int:
    """K = G / (b * dp); raises ValueError naming the numbers when it is not a whole number."""
    b, dp = workload.micro_batch, layout.dp
    if workload.global_batch is None:
        assert workload.microbatches is not None  # Workload refuses neither
        return workload.microbatches
    g = workload.global_batch
    if g % (b * dp):
        raise ValueError(f"global batch {g} is not divisible by micro-batch {b} x dp {dp}")
    k = g // (b * dp)
    if workload.microbatches is not None and workload.microbatches != k:
        raise ValueError(
            f"micro-batches {workload.microbatches} disagree with G / (b * dp) = "
            f"{g} / ({b} * {dp}) = {k}"
        )
    return k


def global_batch_for(workload: Workload, layout: Layout) -> int:
    return microbatches_for(workload, layout) * workload.micro_batch * layout.dp


def flat_buffered(workload: Workload, layout: Layout) -> bool:
    """Whether the data-parallel wrappers keep flat buffers: under ZeRO, and under a stage 0
    in mixed precision, whose wrapper keeps one unsharded buffer (train/build.py
    `data_parallel`); DataParallel in float32 keeps the parameters whole."""
    return layout.zero > 0 or workload.precision.name != "fp32"
