"""Every check on user input, run by the CLI before any worker starts.

Each failure is a ValueError whose one-line message names the bad value and what would be
valid; the CLI prints it and exits with status 2.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from paratrain.config import (
    ARCHS,
    BACKENDS,
    COMM_ALGOS,
    COMM_ORDERS,
    COMPUTE_DTYPES,
    CP_METHODS,
    DC_MODES,
    DEVICES,
    DP_MODES,
    EFFECTS,
    GELUS,
    LR_SCALINGS,
    RECOMPUTE_MODES,
    SCHEDULES,
    SECTIONS,
    ZERO2_ACCUMULATE,
    ZERO_STAGES,
    RunConfig,
    parse_straggler,
)
from paratrain.machine import cuda_available
from paratrain.models.plans import check_context_parallel, check_tensor_parallel
from paratrain.models.presets import preset
from paratrain.validate_batch import check_schedule_batch, indivisible_batch
from paratrain.validate_compile import check_compile
from paratrain.validate_experts import check_experts


def resolve(cfg: RunConfig, world_size: int, local_procs: int | None = None) -> RunConfig:
    """Fill the automatic fields (dp, K, G, device, backend, dtype) and check everything.

    local_procs: ranks on this node (torchrun's LOCAL_WORLD_SIZE); default --nproc.
    """
    _check_finite(cfg)
    _check_positive(cfg)
    _check_comm(cfg)
    _resolve_device_defaults(cfg, local_procs or cfg.parallel.nproc)
    _check_not_built_yet(cfg)
    _resolve_mesh(cfg, world_size)
    check_experts(cfg)  # before the pipeline's: a mixture of experts refuses any pipeline
    if cfg.parallel.straggler:
        parse_straggler(cfg.parallel.straggler, world_size)
    _resolve_batch(cfg)
    _check_pipeline(cfg)
    _check_model(cfg)
    _check_tensor_parallel(cfg)
    _check_context_parallel(cfg)
    _check_zero(cfg)
    check_compile(cfg)
    _check_data(cfg)
    return cfg


def _check_finite(cfg: RunConfig) -> None:
    """Every number is a number: NaN compares false with everything, so it would pass the
    range checks below (and infinities the upper bounds)."""
    for section in SECTIONS:
        values = getattr(cfg, section)
        for f in dataclasses.fields(values):
            value = getattr(values, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{section}.{f.name} = {value} must be a finite number")


def _check_positive(cfg: RunConfig) -> None:
    checks = {
        "parallel.nproc": cfg.parallel.nproc,
        "parallel.pp": cfg.parallel.pp,
        "parallel.tp": cfg.parallel.tp,
        "parallel.cp": cfg.parallel.cp,
        "model.n_layer": cfg.model.n_layer,
        "model.n_head": cfg.model.n_head,
        "model.d_model": cfg.model.d_model,
        "model.max_seq_len": cfg.model.max_seq_len,
        "model.vocab_size": cfg.model.vocab_size,
        "train.steps": cfg.train.steps,
        "train.seq_len": cfg.train.seq_len,
        "train.micro_batch": cfg.train.micro_batch,
        "train.lr": cfg.train.lr,
        "train.log_every": cfg.train.log_every,
        "parallel.comm_timeout_s": cfg.parallel.comm_timeout_s,
        "train.max_skipped_steps": cfg.train.max_skipped_steps,
        "train.loss_scale": cfg.train.loss_scale,
    }
    for name, value in checks.items():
        if not value > 0:  # written so that NaN fails
            raise ValueError(f"{name} = {value} must be positive")
    non_negative = {
        "parallel.dp": cfg.parallel.dp,
        "train.global_batch": cfg.train.global_batch,
        "train.microbatches": cfg.train.microbatches,
        "train.warmup_steps": cfg.train.warmup_steps,
        "train.weight_decay": cfg.train.weight_decay,
        "train.grad_clip": cfg.train.grad_clip,
        "train.val_batches": cfg.train.val_batches,
        "train.checkpoint_every": cfg.train.checkpoint_every,
        "train.keep_checkpoints": cfg.train.keep_checkpoints,
        "train.rewarmup_steps": cfg.train.rewarmup_steps,
        "parallel.max_restarts": cfg.parallel.max_restarts,
    }
    for name, value in non_negative.items():
        if not value >= 0:
            raise ValueError(f"{name} = {value} must be zero or positive")
    for name, value in {
        "model.dropout": cfg.model.dropout,
        "train.min_lr_ratio": cfg.train.min_lr_ratio,
        "train.beta1": cfg.train.beta1,
        "train.beta2": cfg.train.beta2,
    }.items():
        if not 0.0 <= value < 1.0 and not (name == "train.min_lr_ratio" and value == 1.0):
            raise ValueError(f"{name} = {value} must be in [0, 1)")
    if not 0.0 < cfg.data.val_fraction < 1.0:
        raise ValueError(f"data.val_fraction = {cfg.data.val_fraction} must be in (0, 1)")


def _check_comm(cfg: RunConfig) -> None:
    p, t = cfg.parallel, cfg.train
    if p.comm_algo not in COMM_ALGOS:
        raise ValueError(f"--comm-algo {p.comm_algo!r}; valid: {', '.join(COMM_ALGOS)}")
    if p.comm_order not in COMM_ORDERS:
        raise ValueError(f"--comm-order {p.comm_order!r}; valid: {', '.join(COMM_ORDERS)}")
    if not p.bucket_mb >= 0:
        raise ValueError(f"--bucket-mb {p.bucket_mb} must be zero (one bucket) or positive")
    if p.dp_mode not in DP_MODES:
        raise ValueError(f"--dp-mode {p.dp_mode!r}; valid: {', '.join(DP_MODES)}")
    if not (p.dc_lambda >= 0 and p.staleness_bound >= 0):
        raise ValueError(
            f"--dc-lambda {p.dc_lambda} and --staleness-bound {p.staleness_bound} must be >= 0"
        )
    if p.dc_mode not in DC_MODES:
        raise ValueError(f"--dc-mode {p.dc_mode!r}; valid: {', '.join(DC_MODES)}")
    if not 0.0 <= p.dc_decay < 1.0:  # written so that NaN fails
        raise ValueError(f"--dc-decay {p.dc_decay} must be in [0, 1)")
    if t.lr_scaling not in LR_SCALINGS:
        raise ValueError(f"--lr-scaling {t.lr_scaling!r}; valid: {', '.join(LR_SCALINGS)}")
    if t.recompute not in RECOMPUTE_MODES:
        valid = ", ".join(RECOMPUTE_MODES)
        raise ValueError(f"--recompute {t.recompute!r}; valid: {valid}")
    if t.lr_base_batch < 1:
        raise ValueError(f"--lr-base-batch {t.lr_base_batch} must be positive")


def _resolve_device_defaults(cfg: RunConfig, local_procs: int) -> None:
    """Device first (auto: cuda when present), then the backend and dtype it implies."""
    p = cfg.parallel
    # torch answers only where a driver is present, and only if the device is to be decided
    cuda = p.device in ("auto", "cuda") and cuda_available()
    if p.device == "auto":
        p.device = "cuda" if cuda else "cpu"
    elif p.device not in DEVICES:
        raise ValueError(f"--device {p.device!r}; valid: auto, {', '.join(DEVICES)}")
    elif p.device == "cuda" and not cuda:
        raise ValueError("--device cuda: this machine has no CUDA device; use --device cpu")
    if p.device == "cuda":
        import torch

        if local_procs > torch.cuda.device_count():
            raise ValueError(
                f"{local_procs} ranks on this node with --device cuda need {local_procs} GPUs "
                f"(one per rank); it has {torch.cuda.device_count()}"
            )
    wanted = "nccl" if p.device == "cuda" else "gloo"
    if p.backend == "auto":
        p.backend = wanted
    elif p.backend not in BACKENDS:
        raise ValueError(f"--backend {p.backend!r}; valid: auto, {', '.join(BACKENDS)}")
    elif p.backend != wanted:
        raise ValueError(
            f"--backend {p.backend} with --device {p.device}: tensors on {p.device} travel "
            f"over {wanted}; use --backend {wanted} or auto"
        )
    dtype = cfg.train.dtype
    if dtype == "auto":
        cfg.train.dtype = "bfloat16" if p.device == "cuda" else "float32"
    elif dtype not in COMPUTE_DTYPES:
        raise ValueError(f"train.dtype = {dtype!r}; valid: auto, {', '.join(COMPUTE_DTYPES)}")


def _check_not_built_yet(cfg: RunConfig) -> None:
    """Combinations named now so scripts can rely on them, refused until they land."""
    t, p = cfg.train, cfg.parallel
    if t.dtype == "float16" and (p.pp > 1 or p.dp_mode == "async"):
        raise ValueError(
            f"--dtype float16 with --pp {p.pp} --dp-mode {p.dp_mode}: fp16 loss scaling runs "
            "with pp = 1 and sync data parallelism (each pipeline chunk would scale again); "
            "use --dtype bfloat16, which needs no loss scale"
        )


def _resolve_mesh(cfg: RunConfig, world_size: int) -> None:
    p = cfg.parallel
    # The other axes' degrees as the messages name them (cp only when it is on).
    axes = {"pp": p.pp, **({"cp": p.cp} if p.cp != 1 else {}), "tp": p.tp}
    names, values = " * ".join(axes), " * ".join(map(str, axes.values()))
    others = math.prod(axes.values())
    if p.dp == 0:
        if world_size % others != 0:
            raise ValueError(
                f"world size {world_size} is not divisible by {names} = {values}; "
                "choose degrees whose product divides the number of processes"
            )
        p.dp = world_size // others
    if p.dp * others != world_size:
        raise ValueError(
            f"dp * {names} = {p.dp} * {values} = {p.dp * others} but the world size "
            f"is {world_size}; choose degrees whose product is {world_size}"
        )


def _resolve_batch(cfg: RunConfig) -> None:
    """G sequences per step, b per micro-batch, K = G / (b * dp) micro-batches per replica."""
    t, dp = cfg.train, cfg.parallel.dp
    if cfg.parallel.dp_mode == "async":
        if dp < 2 or cfg.parallel.pp * cfg.parallel.tp != 1:
            raise ValueError(
                f"--dp-mode async needs pp = tp = 1 and dp >= 2 (one server, at least one "
                f"worker); got dp={dp} pp={cfg.parallel.pp} tp={cfg.parallel.tp}"
            )
        dp -= 1  # rank 0 serves parameters; the other ranks are the replicas
    per_pass = t.micro_batch * dp
    if t.microbatches and not t.global_batch:
        t.global_batch = t.microbatches * per_pass
    if t.global_batch == 0:
        raise ValueError("give --global-batch G or --microbatches K (both are 0)")
    if t.global_batch % per_pass != 0:
        raise ValueError(indivisible_batch(t.global_batch, t.micro_batch, dp))
    k = t.global_batch // per_pass
    if t.microbatches and t.microbatches != k:
        raise ValueError(
            f"--microbatches {t.microbatches} disagrees with --global-batch {t.global_batch}: "
            f"G / (b * dp) = {t.global_batch} / ({t.micro_batch} * {dp}) = {k}"
        )
    t.microbatches = k


def _check_pipeline(cfg: RunConfig) -> None:
    """Build (and so check) the schedule now: its errors name the valid K and chunks."""
    p, m = cfg.parallel, cfg.model
    if p.schedule not in SCHEDULES:
        raise ValueError(f"--schedule {p.schedule!r}; valid: {', '.join(SCHEDULES)}")
    if p.chunks < 1:
        raise ValueError(f"--chunks {p.chunks} must be at least 1")
    if p.pp == 1:
        if p.chunks != 1:
            raise ValueError(f"--chunks {p.chunks} needs a pipeline (--pp 2 or more)")
        if cfg.train.trace:
            raise ValueError("--trace draws the pipeline schedule: use --pp 2 or more, or drop it")
        return
    if p.pp * p.chunks > m.n_layer:
        raise ValueError(
            f"--pp {p.pp} x --chunks {p.chunks} = {p.pp * p.chunks} pipeline pieces but the "
            f"model has {m.n_layer} layers; use at most {m.n_layer} pieces"
        )
    if p.dp_mode == "async":
        raise ValueError("--dp-mode async does not combine with a pipeline; use --pp 1")
    check_schedule_batch(cfg)


def _check_zero(cfg: RunConfig) -> None:
    p, t = cfg.parallel, cfg.train
    if p.zero not in ZERO_STAGES:
        raise ValueError(f"--zero {p.zero}; valid: {', '.join(map(str, ZERO_STAGES))}")
    if p.prefetch < 0:
        raise ValueError(f"--prefetch {p.prefetch} must be zero or positive")
    if p.zero2_accumulate not in ZERO2_ACCUMULATE:
        valid = ", ".join(ZERO2_ACCUMULATE)
        raise ValueError(f"--zero2-accumulate {p.zero2_accumulate!r}; valid: {valid}")
    sharded = p.zero > 0 or t.dtype != "float32"
    if sharded and p.dp_mode == "async":
        raise ValueError("--dp-mode async keeps the whole model on the server; use --zero 0")
    if p.zero == 3 and p.pp > 1:
        raise ValueError(
            "--zero 3 with a pipeline (--pp > 1) is refused: every micro-batch would gather "
            "the stage's parameters again (DeepSpeed forbids it too); use --zero 1 or 2"
        )


def _check_tensor_parallel(cfg: RunConfig) -> None:
    p = cfg.parallel
    if p.tp == 1:
        if p.sequence_parallel:
            raise ValueError("--sequence-parallel needs tensor parallelism (--tp 2 or more)")
        return
    if p.dp_mode == "async":
        raise ValueError("--dp-mode async does not combine with tensor parallelism; use --tp 1")
    if p.sequence_parallel and p.pp > 1:
        raise ValueError(
            "--sequence-parallel with a pipeline (--pp > 1) is not supported yet: stages "
            "exchange whole sequences; drop one of them"
        )
    check_tensor_parallel(cfg.model, p.tp, cfg.train.seq_len, p.sequence_parallel)


def _check_context_parallel(cfg: RunConfig) -> None:
    p, m = cfg.parallel, cfg.model
    if p.cp_method not in CP_METHODS:
        raise ValueError(f"--cp-method {p.cp_method!r}; valid: {', '.join(CP_METHODS)}")
    if p.cp == 1:
        return
    if p.dp_mode == "async":
        raise ValueError(
            f"--cp {p.cp} with --dp-mode async: the server holds no sequence; use --cp 1"
        )
    if m.dropout > 0:
        raise ValueError(
            f"--cp {p.cp} with model.dropout = {m.dropout}: ring and all-to-all attention have "
            "no attention dropout; use dropout 0 or --cp 1"
        )
    check_context_parallel(m, p.cp, p.cp_method, p.tp, cfg.train.seq_len, p.sequence_parallel)


# Fields that only one architecture reads, with the value the other must keep.
ARCH_ONLY = {
    "gpt": {"n_kv_head": 0, "ffn_hidden": 0, "rope_theta": 10000.0, "norm_eps": 1e-5},
    "llama": {"dropout": 0.0, "activation": "gelu"},
}


def _check_model(cfg: RunConfig) -> None:
    m = cfg.model
    preset(m.name)  # a known preset (its fields are the defaults the others override)
    if m.arch not in ARCHS:
        raise ValueError(f"model.arch = {m.arch!r}; valid: {', '.join(ARCHS)}")
    if m.activation not in GELUS:
        raise ValueError(f"model.activation = {m.activation!r}; valid: {', '.join(GELUS)}")
    for name, value in ARCH_ONLY[m.arch].items():
        if getattr(m, name) != value and not (name == "n_kv_head" and m.n_kv_head == m.n_head):
            other = next(a for a in ARCHS if a != m.arch)
            raise ValueError(
                f"model.{name} = {getattr(m, name)!r} applies to arch {other} only; "
                f"this model is {m.arch} (leave it at {value!r})"
            )
    if m.n_kv_head < 0 or m.ffn_hidden < 0 or not (m.rope_theta > 0 and m.norm_eps > 0):
        raise ValueError(
            f"model.n_kv_head {m.n_kv_head} and ffn_hidden {m.ffn_hidden} must be >= 0, "
            f"rope_theta {m.rope_theta} and norm_eps {m.norm_eps} positive"
        )
    if m.n_head % (m.n_kv_head or m.n_head):
        raise ValueError(
            f"model.n_kv_head = {m.n_kv_head} does not divide model.n_head = {m.n_head}; "
            "each key/value head serves a whole group of query heads"
        )
    if m.d_model % m.n_head != 0:
        raise ValueError(
            f"model.n_head = {m.n_head} does not divide model.d_model = {m.d_model}; "
            f"choose a divisor of {m.d_model}"
        )
    if cfg.train.seq_len > m.max_seq_len:
        raise ValueError(
            f"train.seq_len = {cfg.train.seq_len} exceeds model.max_seq_len = {m.max_seq_len}; "
            f"use at most {m.max_seq_len} or raise max_seq_len"
        )


def _check_data(cfg: RunConfig) -> None:
    path = cfg.data.path
    if path and not Path(path).exists():
        raise ValueError(f"--data {path!r} does not exist; give a text file, a folder or a .bin")
    if cfg.data.tokenizer and path.endswith(".bin"):
        raise ValueError(
            f"--tokenizer with --data {path!r}: a .bin holds token ids already; leave one out"
        )
    ids = (path and path.endswith(".bin")) or cfg.data.tokenizer
    ids = ids or (path and (Path(path) / "meta.json").is_file())  # a prepared directory
    if not ids and cfg.model.vocab_size < 256:
        raise ValueError(
            f"model.vocab_size = {cfg.model.vocab_size} is too small for byte-level text; "
            "use at least 256"
        )


def check_effective(cfg: RunConfig, given: dict[str, str]) -> None:
    """Refuse a field given explicitly (`given`: 'section.name' -> its flag, or "in FILE") with a
    value other than its default where it has no effect (config.EFFECTS says when)."""
    for key, how in given.items():
        effect = EFFECTS[key]
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if effect is None or effect.applies(cfg) or value == _default(section, name):
            continue
        if not how.startswith("--"):
            given_as = f"{key} = {value!r} {how}"
        elif isinstance(value, bool):
            given_as = how if value else f"--no-{how[2:]}"
        else:
            given_as = f"{how} {value}"
        raise ValueError(f"{given_as} has no effect here: it needs {effect.needs}")


def _default(section: str, name: str) -> object:
    return getattr(SECTIONS[section](), name)
