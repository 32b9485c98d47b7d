"""[parallel]: how the ranks split the work, and how they talk."""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.config.choices import (
    AUTO,
    BACKENDS,
    COMM_ALGOS,
    COMM_ORDERS,
    COMPRESS_METHODS,
    CP_METHODS,
    DC_MODES,
    DEVICES,
    DP_MODES,
    OUTER_DTYPES,
    SCHEDULES,
    ZERO2_ACCUMULATE,
    ZERO_STAGES,
)
from paratrain.config.conditions import (
    ASYNC,
    COLLECTIVES,
    COMPRESSING,
    DC_ASGD,
    DILOCO,
    PIPELINE,
    POWERSGD,
    world,
)
from paratrain.config.fields import Effect, param


@dataclass
class ParallelFields:
    """The parallel section's fields but fault tolerance's (parallel_config.py)."""

    nproc: int = param(2, "Local worker processes started by the launcher.", at_least=1)
    dp: int = param(0, "Data-parallel degree; 0 means world size / (pp * cp * tp).", at_least=0)
    pp: int = param(1, "Pipeline-parallel degree (stages).", at_least=1)
    tp: int = param(1, "Tensor-parallel degree.", at_least=1)
    cp: int = param(1, "Context-parallel degree: each sequence split over cp ranks.", at_least=1)
    cp_method: str = param(
        "ring",
        "Context-parallel attention (alltoall: Ulysses, heads split).",
        choices=CP_METHODS,
        effect=Effect(lambda c: c.parallel.cp > 1, "--cp 2 or more"),
    )
    ep: int = param(
        1, "Expert-parallel degree: experts split over ep of the dp ranks (divides dp).", at_least=1
    )
    zero: int = param(
        0, "ZeRO stage within the data-parallel group (3 = FSDP).", choices=ZERO_STAGES
    )
    replicas: int = param(
        1,
        "HSDP: the data-parallel ranks form this many replica groups; ZeRO shards within a"
        " group and gradients are all-reduced across groups (divides dp; 1 = plain ZeRO).",
        at_least=1,
        effect=Effect(
            lambda c: c.parallel.zero > 0 or c.parallel.dp_mode == "diloco",
            "--zero 1, 2 or 3, or --dp-mode diloco",
        ),
    )
    prefetch: int = param(
        1,
        "ZeRO-3: units gathered ahead of the one computing.",
        at_least=0,
        effect=Effect(lambda c: c.parallel.zero == 3, "--zero 3"),
    )
    zero2_accumulate: str = param(
        "shard",
        "ZeRO-2 with K micro-batches: shard reduce-scatters every micro-batch into the shard,"
        " as DeepSpeed (1/k gradient memory, K x gradient traffic); full keeps the whole"
        " gradient until the last micro-batch, one reduce-scatter (at its peak no saving over"
        " ZeRO-1).",
        choices=ZERO2_ACCUMULATE,
        effect=Effect(
            lambda c: c.parallel.zero == 2 and c.train.microbatches > 1,
            "--zero 2 with more than one micro-batch per step",
        ),
    )
    schedule: str = param("1f1b", "Pipeline schedule.", choices=SCHEDULES, effect=PIPELINE)
    sequence_parallel: bool = param(
        False,
        "Split LayerNorm/dropout regions along the sequence over tp.",
        effect=Effect(lambda c: c.parallel.tp > 1, "--tp 2 or more"),
    )
    chunks: int = param(
        1,
        "Model chunks per pipeline stage (v); interleaved needs 2 or more.",
        at_least=1,
        effect=PIPELINE,
    )
    device: str = param(
        AUTO,
        "Where each rank computes: cuda is cuda:LOCAL_RANK; auto is cuda if present.",
        choices=(AUTO, *DEVICES),
    )
    backend: str = param(
        AUTO,
        "torch.distributed backend; auto is nccl for cuda, else gloo.",
        choices=(AUTO, *BACKENDS),
    )
    comm_timeout_s: float = param(
        300.0,
        "Seconds before a collective that never completes fails.",
        above=0,
        effect=COLLECTIVES,
    )
    # The asynchronous server and workers only send and receive: no collective to choose.
    comm_algo: str = param(
        "native",
        "Default collective algorithm.",
        choices=COMM_ALGOS,
        effect=Effect(
            lambda c: world(c) > 1 and c.parallel.dp_mode != "async",
            "more than one process in --dp-mode sync or diloco",
        ),
    )
    # NCCL orders its calls itself: the order is enforced on gloo groups only.
    comm_order: str = param(
        "gloo",
        "Order of communication calls on gloo: gloo's own (forgiving), or nccl's, each call"
        " waiting its turn as on NCCL's streams, so that a program that would deadlock on"
        " GPUs fails here with a report (docs/comm.md).",
        choices=COMM_ORDERS,
        effect=Effect(
            lambda c: world(c) > 1 and c.parallel.backend == "gloo",
            "more than one process on gloo (--device cpu)",
        ),
    )
    bucket_mb: float = param(
        25.0,
        "Gradient bucket size in MiB; 0 puts the whole model in one.",
        at_least=0,
        effect=Effect(
            lambda c: c.parallel.dp_mode != "async" and c.parallel.zero != 3 and c.parallel.dp > 1,
            "data parallelism (dp 2 or more) without ZeRO-3 (its units are its buckets)",
        ),
    )
    compress: str = param(
        "none",
        "Error-feedback compression of the data-parallel gradient reduction: powersgd (rank"
        " --compress-rank per matrix), int8 or sign (a float32 scale per 256 elements); under"
        " HSDP, of the reduction across the replica groups only (docs/compression.md).",
        choices=COMPRESS_METHODS,
        effect=Effect(
            lambda c: c.parallel.dp > 1 and c.parallel.dp_mode == "sync",
            "data parallelism (dp 2 or more) in --dp-mode sync",
        ),
    )
    compress_rank: int = param(
        1,
        "PowerSGD's rank: each gradient matrix (a linear layer's) sent as two factors of this"
        " many columns; a matrix no larger than it is averaged exactly.",
        at_least=1,
        effect=POWERSGD,
    )
    compress_start: int = param(
        0,
        "Steps whose gradients are reduced exactly before --compress starts.",
        at_least=0,
        effect=COMPRESSING,
    )
    dp_mode: str = param(
        "sync",
        "Data parallel: sync all-reduces gradients, async runs a parameter server, diloco"
        " trains each replica group (--replicas) on its own and averages their parameter"
        " changes every --sync-every steps (docs/diloco.md).",
        choices=DP_MODES,
    )
    sync_every: int = param(
        100,
        "DiLoCo: inner steps between outer steps, H (the last step always synchronizes).",
        at_least=1,
        effect=DILOCO,
    )
    fragments: int = param(
        1,
        "DiLoCo: Streaming DiLoCo's fragments of consecutive blocks, each synchronized once"
        " per --sync-every steps at its own offset (1: all at once).",
        at_least=1,
        effect=DILOCO,
    )
    sync_delay: int = param(
        0,
        "DiLoCo: Streaming DiLoCo's overlap, tau: an outer step lands this many inner steps"
        " after it starts (below --sync-every).",
        at_least=0,
        effect=DILOCO,
    )
    merge_alpha: float = param(
        0.0,
        "DiLoCo: where an outer step lands, each local parameter becomes alpha x local +"
        " (1 - alpha) x global (0: the global one; 1: the local one, until the run's end).",
        at_least=0,
        at_most=1,
        effect=DILOCO,
    )
    outer_dtype: str = param(
        "float32",
        "DiLoCo: the pseudo-gradient on the wire; bfloat16, or int8 and fp4 with a float32"
        " scale per 256 elements, averaged in a reduce-scatter and an all-gather of bytes.",
        choices=OUTER_DTYPES,
        effect=DILOCO,
    )
    outer_lr: float = param(0.7, "DiLoCo: the outer SGD's learning rate.", above=0, effect=DILOCO)
    outer_momentum: float = param(
        0.9, "DiLoCo: the outer SGD's momentum (0: none).", at_least=0, below=1, effect=DILOCO
    )
    outer_nesterov: bool = param(
        True, "DiLoCo: Nesterov momentum in the outer step.", effect=DILOCO
    )
    dc_lambda: float = param(
        0.0, "Async: DC-ASGD delay compensation strength (0 = off).", at_least=0, effect=ASYNC
    )
    dc_mode: str = param(
        "constant",
        "Async DC-ASGD's lambda; adaptive is DC-ASGD-a: per coordinate, --dc-lambda / sqrt of"
        " a moving average of g*g.",
        choices=DC_MODES,
        effect=DC_ASGD,
    )
    dc_decay: float = param(
        0.95,
        "Async, --dc-mode adaptive: decay m of that average.",
        at_least=0,
        below=1,
        effect=Effect(
            lambda c: DC_ASGD.applies(c) and c.parallel.dc_mode == "adaptive",
            "--dp-mode async, --dc-lambda above 0 and --dc-mode adaptive",
        ),
    )
    staleness_bound: int = param(
        0, "Async: drop gradients staler than this (0 = no bound).", at_least=0, effect=ASYNC
    )
    straggler: str = param(
        "",
        "Make one rank slower, RANK:FACTOR (e.g. 1:3 = 3x its compute).",
        default_means="none",
    )
    max_restarts: int = param(
        0,
        "Restart all workers up to N times after a failure; they resume from a checkpoint"
        " (with --fault-tolerance only the failed replica group, from a live peer).",
        at_least=0,
        effect=Effect(lambda c: c.parallel.nproc > 1, "--nproc 2 or more"),
    )
