"""Run configuration: dataclasses with a help text per field, and when each field matters.

Precedence is CLI flag > TOML file > default. For example, with `run.toml` holding
`[train]\nsteps = 50` the command `paratrain train --config run.toml --steps 80` runs 80
steps, and without `--steps` it runs 50. Every check that can fail on user input lives
in `validate`, which the CLI calls before any worker starts; reading and writing TOML is
config_toml.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The valid values of the string (and stage) fields, defined once: validate.py checks them,
# and the modules that implement each option take their lists from here.
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
DTYPE_SHORT_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}  # in code only
RECOMPUTE_MODES = ("none", "selective", "full")  # parallel/recompute.py
ZERO_STAGES = (0, 1, 2, 3)
ZERO2_ACCUMULATE = ("full", "shard")
COMM_ALGOS = ("native", "ring", "tree")
COMM_ORDERS = ("gloo", "nccl")  # comm/ordering.py
BACKENDS = ("gloo", "nccl")
DEVICES = ("cpu", "cuda")
DP_MODES = ("sync", "async")
DC_MODES = ("constant", "adaptive")  # DC-ASGD-c and DC-ASGD-a (parallel/data_parallel/async_sgd.py)
LR_SCALINGS = ("none", "linear", "sqrt")
CP_METHODS = ("ring", "alltoall")  # parallel/context_parallel/apply.py: METHODS
ARCHS = ("gpt", "llama")  # models/gpt.py, models/llama.py
GELUS = ("gelu", "gelu_tanh")


def one_of(values: tuple[str, ...]) -> str:
    """'a, b or c': the choices as a help text reads them."""
    return ", ".join(values[:-1]) + " or " + values[-1]


def param(default: Any, help: str) -> Any:
    """A dataclass field whose help text becomes the `--help` line of its CLI flag."""
    return field(default=default, metadata={"help": help})


@dataclass
class ModelConfig:
    name: str = param(
        "gpt-tiny", "Model preset (models/presets.py); its shape is the default of every field."
    )
    arch: str = param("gpt", f"Architecture: {one_of(ARCHS)}.")
    vocab_size: int = param(256, "Vocabulary size; 256 for byte-level text.")
    n_layer: int = param(4, "Number of transformer blocks.")
    n_head: int = param(4, "Attention heads per block; must divide d_model.")
    n_kv_head: int = param(0, "llama: key/value heads (grouped-query attention); 0: n_head.")
    d_model: int = param(128, "Width of the residual stream.")
    ffn_hidden: int = param(0, "llama: SwiGLU's inner width; 0: 8/3 d_model, rounded up to 32.")
    max_seq_len: int = param(256, "Longest training sequence (gpt: the position table's rows).")
    tie_embeddings: bool = param(False, "The output head shares the token embedding's matrix.")
    rope_theta: float = param(10000.0, "llama: base of the rotary position frequencies.")
    norm_eps: float = param(1e-5, "llama: RMSNorm's epsilon.")
    dropout: float = param(0.0, "gpt: dropout in embeddings, attention and residuals.")
    activation: str = param(
        "gelu", f"gpt: the MLP's GELU, {one_of(GELUS)} (GPT-2's tanh approximation)."
    )
    # Mixture of experts (models/moe.py, docs/experts.md): every block's MLP becomes one.
    num_experts: int = param(0, "Experts per MoE feed-forward (each as wide as the MLP); 0: dense.")
    top_k: int = param(2, "MoE: experts each token is sent to (1: Switch, 2: GShard).")
    capacity_factor: float = param(
        0.0,
        "MoE: each expert takes at most ceil(factor * k * T / E) of a batch's T tokens; 0: all.",
    )
    aux_loss_coef: float = param(0.01, "MoE: weight of Switch's load-balancing loss; 0: none.")
    bias_rate: float = param(
        0.0, "MoE: DeepSeek-V3's balancing bias step per optimizer step; 0: off."
    )
    shared_expert: bool = param(
        False, "MoE: add a shared expert (as wide as the MLP) for every token."
    )


@dataclass
class ParallelConfig:
    nproc: int = param(2, "Local worker processes started by the launcher.")
    dp: int = param(0, "Data-parallel degree; 0 means world size / (pp * cp * tp).")
    pp: int = param(1, "Pipeline-parallel degree (stages).")
    tp: int = param(1, "Tensor-parallel degree.")
    cp: int = param(1, "Context-parallel degree: each sequence split over cp ranks.")
    cp_method: str = param(
        "ring", f"Context-parallel attention: {one_of(CP_METHODS)} (Ulysses, heads split)."
    )
    ep: int = param(
        1, "Expert-parallel degree: experts split over ep of the dp ranks (divides dp)."
    )
    zero: int = param(0, "ZeRO stage 0-3 within the data-parallel group (3 = FSDP).")
    prefetch: int = param(1, "ZeRO-3: units gathered ahead of the one computing.")
    zero2_accumulate: str = param(
        "shard",
        "ZeRO-2 with K micro-batches: shard (reduce-scatter every micro-batch into the shard,"
        " as DeepSpeed: 1/k gradient memory, K x gradient traffic) or full (whole gradient"
        " until the last micro-batch, one reduce-scatter: at its peak no saving over ZeRO-1).",
    )
    schedule: str = param("1f1b", f"Pipeline schedule: {one_of(SCHEDULES)}.")
    sequence_parallel: bool = param(
        False, "Split LayerNorm/dropout regions along the sequence over tp."
    )
    chunks: int = param(1, "Model chunks per pipeline stage (v); interleaved needs 2 or more.")
    device: str = param(
        "auto", "Where each rank computes: cpu, cuda (cuda:LOCAL_RANK), or auto (cuda if present)."
    )
    backend: str = param(
        "auto", "torch.distributed backend: gloo, nccl, or auto (nccl for cuda, else gloo)."
    )
    comm_timeout_s: float = param(300.0, "Seconds before a collective that never completes fails.")
    comm_algo: str = param("native", f"Default collective algorithm: {one_of(COMM_ALGOS)}.")
    comm_order: str = param(
        "gloo",
        "Order of communication calls on gloo: gloo (its own, forgiving) or nccl (each call"
        " waits its turn as on NCCL's streams, so a program that would deadlock on GPUs"
        " fails here with a report; docs/comm.md).",
    )
    bucket_mb: float = param(25.0, "Gradient bucket size in MiB; 0 puts the whole model in one.")
    dp_mode: str = param("sync", "Data parallel: sync (all-reduce) or async (parameter server).")
    dc_lambda: float = param(0.0, "Async: DC-ASGD delay compensation strength (0 = off).")
    dc_mode: str = param(
        "constant",
        f"Async DC-ASGD's lambda: {one_of(DC_MODES)} (DC-ASGD-a: per coordinate, --dc-lambda"
        " / sqrt of a moving average of g*g).",
    )
    dc_decay: float = param(0.95, "Async, --dc-mode adaptive: decay m of that average, in [0, 1).")
    staleness_bound: int = param(0, "Async: drop gradients staler than this (0 = no bound).")
    straggler: str = param("", "Make one rank slower, RANK:FACTOR (e.g. 1:3 = 3x its compute).")
    max_restarts: int = param(
        0, "Restart all workers up to N times after a failure; they resume from a checkpoint."
    )


@dataclass
class TrainConfig:
    steps: int = param(300, "Optimizer steps.")
    seq_len: int = param(128, "Tokens per training sequence.")
    global_batch: int = param(16, "Sequences per optimizer step (G), over all replicas.")
    micro_batch: int = param(8, "Sequences per forward pass (b).")
    microbatches: int = param(
        0, "Micro-batches per replica per step (K = G / (b * dp)); 0: from G."
    )
    lr: float = param(3e-3, "Peak learning rate (after warmup), at batch lr_base_batch.")
    lr_scaling: str = param("none", f"Scale lr with the global batch: {one_of(LR_SCALINGS)}.")
    lr_base_batch: int = param(16, "Global batch at which lr applies unscaled.")
    min_lr_ratio: float = param(
        0.1, "Final learning rate of the cosine decay, as a fraction of lr."
    )
    warmup_steps: int = param(30, "Steps of linear warmup from 0 to lr.")
    weight_decay: float = param(0.1, "AdamW weight decay, applied to matrices and embeddings only.")
    beta1: float = param(0.9, "AdamW beta1.")
    beta2: float = param(0.95, "AdamW beta2.")
    recompute: str = param(
        "none", f"Activation recomputation per block: {one_of(RECOMPUTE_MODES)}."
    )
    compile: bool = param(
        False,
        "Compile each transformer block with torch.compile (inductor); on the CPU this needs "
        "a C++ compiler.",
    )
    grad_clip: float = param(1.0, "Clip the global gradient norm to this value; 0 disables.")
    seed: int = param(1234, "Seed for model initialisation and data order.")
    dtype: str = param(
        "auto", "Compute dtype: float32, bfloat16, or auto (bf16 on cuda, else fp32)."
    )
    loss_scale: float = param(
        2.0**16, "fp16 only: initial loss scale, halved on overflow (step skipped), then grown."
    )
    val_batches: int = param(8, "Batches of held-out data for the final validation loss.")
    log_every: int = param(10, "Steps between log lines when stderr is not a terminal.")
    trace: bool = param(
        False, "Pipeline: write the last step's trace.json and timeline.png; needs pp >= 2."
    )
    out: str = param("", "Run directory; default runs/<date>-<time>.")
    checkpoint_every: int = param(
        100, "Save a sharded checkpoint every N steps and after the last; 0: after the last only."
    )
    keep_checkpoints: int = param(3, "Complete checkpoints kept (the newest); 0 keeps all.")
    resume: str = param("", "Continue the run in this run directory from its latest checkpoint.")
    tensorboard: bool = param(
        False, "Also write the per-step metrics as TensorBoard event files in RUN_DIR/tensorboard."
    )
    init_from: str = param(
        "",
        "Start from this run directory's latest weights (a run or an import-hf), fresh "
        "optimizer, step 0; its [model] is the default.",
    )
    rewarmup_steps: int = param(
        10, "Resumed on another world size: ramp the learning rate up again over N steps."
    )
    max_skipped_steps: int = param(
        3, "Abort after N consecutive steps skipped for a non-finite loss or gradient norm."
    )


@dataclass
class DataConfig:
    path: str = param(
        "", "Text file, folder, .bin of uint16 ids, or a prepared directory; default stdlib."
    )
    tokenizer: str = param("", "A tokenizer.json for text data (default: bytes).")
    val_fraction: float = param(0.05, "Fraction of files (or of tokens) held out for validation.")


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)

    @property
    def world_size(self) -> int:
        return _world(self)

    @property
    def tokens_per_step(self) -> int:
        return self.train.global_batch * self.train.seq_len


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "train": TrainConfig,
    "data": DataConfig,
}


def parse_straggler(text: str, world_size: int) -> tuple[int, float]:
    """'RANK:FACTOR' -> (rank, factor): that rank's steps take FACTOR times its compute."""
    try:
        rank_text, factor_text = text.split(":")
        rank, factor = int(rank_text), float(factor_text)
    except ValueError:
        raise ValueError(f"--straggler {text!r}; expected RANK:FACTOR such as 1:3") from None
    if not 0 <= rank < world_size or not factor >= 1:  # written so that NaN fails
        raise ValueError(
            f"--straggler {text!r}: rank must be in 0..{world_size - 1} and factor at least 1"
        )
    return rank, factor


def device_type(cfg: RunConfig) -> str:
    """ "cpu" or "cuda": `auto` means cuda when this machine has it.

    For configurations built in code that never went through `resolve`.
    """
    if cfg.parallel.device == "auto":
        import torch  # only here: the configuration itself needs no torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.parallel.device


def compute_dtype(cfg: RunConfig) -> str:
    """The dtype a run computes in: `auto` means bfloat16 on cuda, float32 elsewhere."""
    if cfg.train.dtype == "auto":
        return "bfloat16" if device_type(cfg) == "cuda" else "float32"
    return cfg.train.dtype


@dataclass(frozen=True)
class Effect:
    """When a field changes what a run does, on the resolved configuration."""

    applies: Callable[[RunConfig], bool]
    needs: str  # the setting it needs, in flags


def _world(cfg: RunConfig) -> int:
    return cfg.parallel.dp * cfg.parallel.pp * cfg.parallel.cp * cfg.parallel.tp


_SYNC = Effect(lambda c: c.parallel.dp_mode == "sync", "--dp-mode sync")
_ASYNC = Effect(lambda c: c.parallel.dp_mode == "async", "--dp-mode async")
_LLAMA = Effect(lambda c: c.model.arch == "llama", "a Llama model (--arch llama)")
_GPT = Effect(lambda c: c.model.arch == "gpt", "a GPT model (--arch gpt)")
_MOE = Effect(lambda c: c.model.num_experts > 0, "a mixture of experts (--num-experts)")
_PIPELINE = Effect(lambda c: c.parallel.pp > 1, "a pipeline (--pp 2 or more)")
_COLLECTIVES = Effect(lambda c: _world(c) > 1, "more than one process")

# Every field of RunConfig: None when it always matters, else when it does. A field given
# explicitly (flag or TOML) with a value other than its default, in a configuration where
# it has no effect, is refused before any worker starts (validate.check_effective).
# tests/test_config.py walks every field against this table.
EFFECTS: dict[str, Effect | None] = {
    **{f"model.{n}": None for n in ("name", "arch", "vocab_size", "n_layer", "n_head",
                                    "d_model", "max_seq_len", "tie_embeddings")},
    **{f"model.{n}": _LLAMA for n in ("n_kv_head", "ffn_hidden", "rope_theta", "norm_eps")},
    "model.num_experts": None,
    **{f"model.{n}": _MOE for n in ("top_k", "capacity_factor", "aux_loss_coef", "bias_rate",
                                    "shared_expert")},
    "model.dropout": _GPT,
    "model.activation": _GPT,
    **{f"parallel.{n}": None for n in ("nproc", "dp", "pp", "tp", "cp", "ep", "zero", "device",
                                       "backend", "dp_mode", "straggler")},
    "parallel.cp_method": Effect(lambda c: c.parallel.cp > 1, "--cp 2 or more"),
    "parallel.prefetch": Effect(lambda c: c.parallel.zero == 3, "--zero 3"),
    "parallel.zero2_accumulate": Effect(
        lambda c: c.parallel.zero == 2 and c.train.microbatches > 1,
        "--zero 2 with more than one micro-batch per step",
    ),
    "parallel.schedule": _PIPELINE,
    "parallel.chunks": _PIPELINE,
    "parallel.sequence_parallel": Effect(lambda c: c.parallel.tp > 1, "--tp 2 or more"),
    "parallel.comm_timeout_s": _COLLECTIVES,
    # The asynchronous server and workers only send and receive: no collective to choose.
    "parallel.comm_algo": Effect(
        lambda c: _world(c) > 1 and c.parallel.dp_mode == "sync",
        "more than one process in --dp-mode sync",
    ),
    # NCCL orders its calls itself: the order is enforced on gloo groups only.
    "parallel.comm_order": Effect(
        lambda c: _world(c) > 1 and c.parallel.backend == "gloo",
        "more than one process on gloo (--device cpu)",
    ),
    "parallel.bucket_mb": Effect(
        lambda c: c.parallel.dp_mode == "sync" and c.parallel.zero != 3 and c.parallel.dp > 1,
        "data parallelism (dp 2 or more) without ZeRO-3 (its units are its buckets)",
    ),
    "parallel.dc_lambda": _ASYNC,
    "parallel.staleness_bound": _ASYNC,
    "parallel.dc_mode": Effect(
        lambda c: c.parallel.dp_mode == "async" and c.parallel.dc_lambda > 0,
        "--dp-mode async with --dc-lambda above 0",
    ),
    "parallel.dc_decay": Effect(
        lambda c: c.parallel.dp_mode == "async" and c.parallel.dc_lambda > 0
        and c.parallel.dc_mode == "adaptive",
        "--dp-mode async, --dc-lambda above 0 and --dc-mode adaptive",
    ),
    "parallel.max_restarts": Effect(lambda c: c.parallel.nproc > 1, "--nproc 2 or more"),
    **{f"train.{n}": None for n in ("steps", "seq_len", "global_batch", "micro_batch",
                                    "microbatches", "lr", "lr_scaling", "min_lr_ratio",
                                    "warmup_steps", "weight_decay", "beta1", "beta2",
                                    "grad_clip", "seed", "dtype", "val_batches", "log_every",
                                    "out", "tensorboard", "init_from", "recompute", "compile",
                                    "checkpoint_every", "keep_checkpoints", "resume")},
    "train.lr_base_batch": Effect(
        lambda c: c.train.lr_scaling != "none", "--lr-scaling linear or sqrt"
    ),
    "train.loss_scale": Effect(lambda c: compute_dtype(c) == "float16", "--dtype float16"),
    "train.trace": _PIPELINE,
    # The parameter server applies every pushed gradient: no step is skipped (yet).
    "train.max_skipped_steps": _SYNC,
    # An asynchronous run resumes with as many workers: its world size never changes.
    "train.rewarmup_steps": Effect(
        lambda c: c.parallel.dp_mode == "sync"
        and (bool(c.train.resume) or c.parallel.max_restarts > 0),
        "--dp-mode sync with --resume or --max-restarts (a changed world size re-warms "
        "the rate)",
    ),
    "data.path": None,
    "data.tokenizer": None,
    "data.val_fraction": Effect(
        lambda c: not (c.data.path and (Path(c.data.path) / "meta.json").is_file()),
        "text or a .bin (a prepared directory has its own held-out split)",
    ),
}  # fmt: skip
