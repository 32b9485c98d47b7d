"""[train] and [data]: the optimizer, the batch, the run's files, and the tokens."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from paratrain.config.choices import (
    AUTO,
    COMPUTE_DTYPES,
    LR_SCALINGS,
    MUON_LR_ADJUSTS,
    MUON_NS_DTYPES,
    OPTIMIZERS,
    PACKINGS,
    RECOMPUTE_MODES,
)
from paratrain.config.conditions import ADAMW, LORA, MUON, PIPELINE, SYNC
from paratrain.config.fields import Effect, param


@dataclass
class TrainConfig:
    steps: int = param(300, "Optimizer steps.", at_least=1)
    seq_len: int = param(128, "Tokens per training sequence.", at_least=1)
    global_batch: int = param(
        16, "Sequences per optimizer step (G), over all replicas.", at_least=0
    )
    micro_batch: int = param(8, "Sequences per forward pass (b).", at_least=1)
    microbatches: int = param(
        0, "Micro-batches per replica per step (K = G / (b * dp)); 0: from G.", at_least=0
    )
    lr: float = param(3e-3, "Peak learning rate (after warmup), at batch lr_base_batch.", above=0)
    lr_scaling: str = param("none", "Scale lr with the global batch.", choices=LR_SCALINGS)
    lr_base_batch: int = param(
        16,
        "Global batch at which lr applies unscaled.",
        at_least=1,
        effect=Effect(lambda c: c.train.lr_scaling != "none", "--lr-scaling linear or sqrt"),
    )
    min_lr_ratio: float = param(
        0.1, "Final learning rate of the cosine decay, as a fraction of lr.", at_least=0, at_most=1
    )
    warmup_steps: int = param(30, "Steps of linear warmup from 0 to lr.", at_least=0)
    weight_decay: float = param(
        0.1, "Weight decay (AdamW's, or SGD's), on matrices and embeddings only.", at_least=0
    )
    beta1: float = param(0.9, "AdamW beta1.", at_least=0, below=1, effect=ADAMW)
    beta2: float = param(0.95, "AdamW beta2.", at_least=0, below=1, effect=ADAMW)
    optimizer: str = param(
        "adamw",
        "muon: Muon for the model plan's hidden matrices, AdamW (as configured) for the rest;"
        " sgd: plain SGD, no momentum (what DiLoCo's equality with data parallelism uses).",
        choices=OPTIMIZERS,
    )
    muon_momentum: float = param(0.95, "Muon's momentum.", at_least=0, below=1, effect=MUON)
    muon_nesterov: bool = param(True, "Muon's Nesterov momentum.", effect=MUON)
    muon_ns_steps: int = param(
        5, "Muon's Newton-Schulz iterations per step.", at_least=1, below=100, effect=MUON
    )
    muon_lr_adjust: str = param(
        "match-rms-adamw",
        "Muon's rate per matrix: original scales lr by sqrt(max(1, rows/cols)); "
        "match-rms-adamw by 0.2 sqrt(max(rows, cols)), so AdamW's lr carries over.",
        choices=MUON_LR_ADJUSTS,
        effect=MUON,
    )
    muon_ns_dtype: str = param(
        AUTO,
        "Muon's Newton-Schulz precision: bfloat16 as torch.optim.Muon; float32 keeps layouts "
        "that sum gradients in other orders within float32 rounding of each other; auto: "
        "bfloat16 on cuda, float32 on the CPU (where bfloat16 products are 20-30x slower).",
        choices=(AUTO, *MUON_NS_DTYPES),
        effect=MUON,
    )
    lora_rank: int = param(
        0,
        "LoRA fine-tuning: freeze the model and train rank-r adapters on --lora-targets "
        "(docs/models.md); 0: train every parameter.",
        at_least=0,
        default_means="0 (no LoRA)",
    )
    lora_alpha: float = param(
        16.0, "LoRA: the adapters' output is scaled by alpha / rank.", above=0, effect=LORA
    )
    lora_targets: str = param(
        "",
        "LoRA: comma-separated module-name patterns of the linear layers to adapt "
        "(blocks.*.attn.q,blocks.*.mlp.up).",
        effect=LORA,
        default_means="the model plan's: attention and MLP projections",
    )
    recompute: str = param("none", "Activation recomputation per block.", choices=RECOMPUTE_MODES)
    compile: bool = param(
        False,
        "Compile each transformer block with torch.compile (inductor); on the CPU this needs "
        "a C++ compiler.",
    )
    grad_clip: float = param(
        1.0, "Clip the global gradient norm to this value; 0 disables.", at_least=0
    )
    seed: int = param(1234, "Seed for model initialisation and data order.")
    dtype: str = param(
        AUTO,
        "Compute dtype; auto is bfloat16 on cuda, else float32.",
        choices=(AUTO, *COMPUTE_DTYPES),
    )
    loss_scale: float = param(
        2.0**16,
        "fp16 only: initial loss scale, halved on overflow (step skipped), then grown.",
        above=0,
        # resolved, dtype is never auto; auto never means float16
        effect=Effect(lambda c: c.train.dtype == "float16", "--dtype float16"),
    )
    val_batches: int = param(
        8, "Batches of held-out data for the final validation loss.", at_least=0
    )
    log_every: int = param(10, "Steps between log lines when stderr is not a terminal.", at_least=1)
    trace: bool = param(
        False,
        "Pipeline: write the last step's trace.json and timeline.png; needs pp >= 2.",
        effect=PIPELINE,
    )
    out: str = param("", "Run directory.", default_means="runs/<date>-<time>")
    checkpoint_every: int = param(
        100,
        "Save a sharded checkpoint every N steps and after the last; 0: after the last only.",
        at_least=0,
    )
    keep_checkpoints: int = param(
        3, "Complete checkpoints kept (the newest); 0 keeps all.", at_least=0
    )
    resume: str = param(
        "", "Continue the run in this run directory from its latest checkpoint.",
        default_means="none",
    )  # fmt: skip
    tensorboard: bool = param(
        False, "Also write the per-step metrics as TensorBoard event files in RUN_DIR/tensorboard."
    )
    init_from: str = param(
        "",
        "Start from this run directory's latest weights (a run or an import-hf), fresh "
        "optimizer, step 0; its [model] is the default.",
        default_means="none",
    )
    # An asynchronous run resumes with as many workers: its world size never changes.
    rewarmup_steps: int = param(
        10,
        "Resumed on another world size: ramp the learning rate up again over N steps.",
        at_least=0,
        effect=Effect(
            lambda c: (
                c.parallel.dp_mode != "async"
                and (bool(c.train.resume) or c.parallel.max_restarts > 0)
            ),
            "--dp-mode sync with --resume or --max-restarts (a changed world size re-warms "
            "the rate)",
        ),
    )
    # The parameter server applies every pushed gradient: no step is skipped (yet).
    max_skipped_steps: int = param(
        3,
        "Abort after N consecutive steps skipped for a non-finite loss or gradient norm.",
        at_least=1,
        effect=SYNC,
    )


@dataclass
class DataConfig:
    path: str = param(
        "",
        "Text file, folder, .bin of uint16 ids, or a prepared directory.",
        flag="--data",
        default_means="stdlib, Python's own library source",
    )
    tokenizer: str = param(
        "", "A tokenizer.json for text data.", default_means="bytes, one token each"
    )
    val_fraction: float = param(
        0.05,
        "Fraction of files (or of tokens) held out for validation.",
        above=0,
        below=1,
        effect=Effect(
            lambda c: not (c.data.path and (Path(c.data.path) / "meta.json").is_file()),
            "text or a .bin (a prepared directory has its own held-out split)",
        ),
    )
    packing: str = param(
        "auto",
        "Rows of a batch: stream (windows of the token stream, documents side by side), "
        "documents (whole documents packed into rows of --seq-len + 1, each attending only "
        "to itself, positions restarting; a prepared directory), none (one document a row, "
        "cut or padded), auto (documents for supervised data, none under --cp > 1; stream "
        "otherwise).",
        choices=PACKINGS,
    )
