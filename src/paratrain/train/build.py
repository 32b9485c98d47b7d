"""From a configuration and a mesh to this rank's engine: the model, made parallel.

The architecture's order: every rank builds the full model from the same seed (so every
layout starts from identical weights), then context parallelism swaps its attention and
positions for those of this rank's tokens, tensor parallelism slices it, --compile
compiles each block, recomputation wraps its blocks, the pipeline split keeps this
stage's chunks, and data parallelism goes last, because it must see the final local
parameters. Each step takes its own group from the mesh and the model's facts from its
plan (models/plans.py); none knows which others are on. Data parallelism reduces over
dp_cp: with cp > 1 the ranks that hold the same parameters are those of every dp and cp
coordinate (the dp group when cp = 1).

Which data-parallel wrapper a configuration gets:
- float32 and --zero 0: DataParallel (gradients whole on every replica, in `.grad`);
- --zero 1 or 2, or a 16-bit --dtype: ZeroDataParallel (stage 0 for mixed precision alone;
  stage 2 reduce-scatters every micro-batch into its shard unless --zero2-accumulate full);
- --zero 3: FullyShardedDataParallel over the model's FSDP units;
each with --compress's settings. Under expert parallelism (--ep > 1) the same choice wraps
the module twice, each holding one share of its parameters over its own group.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import cast

import torch
from torch import nn

from paratrain import checkpoint, comm
from paratrain.checkpoint.whole_model import load_weights, read_model
from paratrain.config import RunConfig, compute_dtype
from paratrain.measure.activations import ActivationMeter
from paratrain.mesh import Mesh
from paratrain.models import registry
from paratrain.models.gpt import GPTConfig
from paratrain.models.moe import aux_loss
from paratrain.models.plans import PLANS, ModelPlan, lora_patterns
from paratrain.parallel.compile import CompiledBlocks, compile_blocks
from paratrain.parallel.context_parallel import TokenShard, apply_context_parallel
from paratrain.parallel.data_parallel import DataParallel
from paratrain.parallel.data_parallel.compression import compress_settings
from paratrain.parallel.data_parallel.fsdp import FullyShardedDataParallel
from paratrain.parallel.data_parallel.fsdp_units import expand_units
from paratrain.parallel.data_parallel.hybrid import HybridGroups
from paratrain.parallel.data_parallel.param_share import EVERY_PARAMETER, ParamShare
from paratrain.parallel.data_parallel.replica import Replica, one_backward
from paratrain.parallel.data_parallel.zero import ZeroDataParallel
from paratrain.parallel.lora import apply_lora, cast_frozen
from paratrain.parallel.mixed_precision import MixedPrecision
from paratrain.parallel.pipeline import (
    PipelinePlan,
    PipelineRuntime,
    build_schedule,
    find_tied_weights,
    split_into_stages,
)
from paratrain.parallel.recompute import apply_recomputation
from paratrain.parallel.tensor_parallel import RngTracker, apply_tensor_parallel
from paratrain.train.engine import Engine, FlatEngine, PipelineEngine
from paratrain.train.experts import DataGroups, apply_experts, hybrid_groups


def run_gpt_config(cfg: RunConfig) -> GPTConfig:
    """The GPT configuration of a run's [model] fields (models.registry.gpt_config)."""
    return registry.gpt_config(cfg.model)


def plan_of(cfg: RunConfig) -> ModelPlan:
    """The parallel plan of the run's architecture (models/plans.py)."""
    return PLANS[cfg.model.arch]


def build_model(
    cfg: RunConfig, device: torch.device | str = "cpu", initial: bool = True
) -> nn.Module:
    """The full plain model, from the run's seed: the same on every rank, then moved to
    `device`. It is initialised on the CPU, whose random stream is the same everywhere,
    so a run starts from the same weights on any device. With --init-from (and `initial`:
    not when a checkpoint will overwrite them), the weights are the source run's latest.
    With --lora-rank, the base is then frozen and adapted (parallel/lora.py): fresh
    adapters from the seed, whatever the base's weights."""
    torch.manual_seed(cfg.train.seed)
    with torch.device("cpu"):  # whatever the default device: the weights are drawn here
        model = registry.plain_model(cfg.model)
    source = cfg.train.init_from
    if source and initial:
        ckpt = checkpoint.latest_checkpoint(Path(source))
        if ckpt is None:
            raise ValueError(f"--init-from {source!r}: no complete checkpoint")
        load_weights(model, read_model(ckpt.path), f"--init-from {source}")
    t = cfg.train
    if t.lora_rank:
        patterns = lora_patterns(t.lora_targets, plan_of(cfg))
        apply_lora(model, patterns, t.lora_rank, t.lora_alpha, t.seed)
    return move_to(model, device)


def move_to(model: nn.Module, device: torch.device | str) -> nn.Module:
    """`model.to(device)`, skipped when every tensor is already there: a no-op for real
    tensors, and under fake tensors (simulate/) `to` would swap each parameter for a copy,
    which fails on parameters the fake mode holds weak references to."""
    device = torch.device(device)
    tensors = [*model.parameters(), *model.buffers()]
    if all(t.device == device for t in tensors):
        return model
    return model.to(device)


def count_params(cfg: RunConfig) -> int:
    """The model's parameter count, from a copy on the meta device: no memory, any size."""
    with torch.device("meta"):
        return sum(p.numel() for p in registry.plain_model(cfg.model).parameters())


# Dropout masks differ between replicas (they see different data) but not between runs:
# rank r's stream starts at seed + RANK_STRIDE * (r + 1). A resume on another layout gives
# each rank work it never had before, so its stream moves on by STEP_STRIDE per step done.
# Both are primes (the 1000th and 10000th), far apart, so nearby seeds, ranks and steps
# do not land on one another's streams.
RANK_STRIDE = 7919
STEP_STRIDE = 104729


def seed_rank_stream(seed: int, global_rank: int, step: int = 0) -> None:
    """Seed this rank's own random stream (dropout), after the shared model is built."""
    torch.manual_seed(seed + RANK_STRIDE * (global_rank + 1) + STEP_STRIDE * step)


def recompute_blocks(model: nn.Module, cfg: RunConfig, plan: ModelPlan | None = None) -> None:
    """--recompute: wrap each of the plan's recompute units (a block) for activation
    recomputation in the run's mode (parallel/recompute.py). After tensor parallelism,
    before data parallelism wraps the model; the asynchronous workers call it too."""
    if cfg.train.recompute == "none":
        return
    plan = plan if plan is not None else plan_of(cfg)
    units = expand_units(model, [plan.recompute_units])
    apply_recomputation([model.get_submodule(n) for [n] in units], cfg.train.recompute)


def compile_units(
    model: nn.Module, cfg: RunConfig, plan: ModelPlan | None = None
) -> CompiledBlocks | None:
    """--compile: each of the plan's compile units (a block) compiled on its own
    (parallel/compile.py). After tensor parallelism, before recomputation wraps the
    compiled forward, the pipeline split and data parallelism."""
    if not cfg.train.compile:
        return None
    plan = plan if plan is not None else plan_of(cfg)
    units = expand_units(model, [plan.compile_units])
    return compile_blocks([(n, model.get_submodule(n)) for [n] in units])


def pipeline_plan(plan: ModelPlan) -> PipelinePlan:
    return PipelinePlan(plan.pipeline_blocks, plan.pipeline_first, plan.pipeline_last)


def build_engine(
    cfg: RunConfig,
    mesh: Mesh,
    plan: ModelPlan | None = None,
    model: nn.Module | None = None,
    packed: bool = False,
) -> Engine:
    """This rank's part of the model, made parallel in the architecture's order.

    plan: the model's facts (default: the run's architecture's, `plan_of(cfg)`).
    model: the full plain model, the same on every rank (default: `build_model(cfg)`).
    packed: its rows hold packed documents (the run's row layout is `documents`).
    """
    p, t = cfg.parallel, cfg.train
    plan = plan if plan is not None else plan_of(cfg)
    model = build_model(cfg, mesh.device) if model is None else move_to(model, mesh.device)
    split = token_split(model, plan, mesh, cfg, packed)
    tracker = None
    if mesh.size("tp") > 1:
        tp = mesh.group("tp")
        sp = p.sequence_parallel
        tp_plan = plan.moe_tensor_parallel if cfg.model.num_experts else plan.tensor_parallel
        assert tp_plan is not None, "a mixture of experts under tp needs moe_tensor_parallel"
        apply_tensor_parallel(model, tp_plan, tp, sequence_parallel=sp, seed=t.seed)
        tracker = cast(RngTracker, model.tp_rng_tracker)  # set by apply_tensor_parallel
    # Both inside each block, so after tensor parallelism; recomputation wraps the compiled
    # forward, since a checkpoint region cannot hold the graph breaks at tp's seams.
    compiled = compile_units(model, cfg, plan)
    recompute_blocks(model, cfg, plan)
    if mesh.size("pp") == 1:
        # One wrapper per share of the parameters (two under expert parallelism).
        groups = DataGroups.of(p.dp_mode)
        shares = apply_experts(model, plan, mesh, groups)
        replicas = [
            data_parallel(model, g, cfg, plan, share=s, hybrid=hybrid_groups(mesh, s, groups))
            for s, g in shares
        ]
        tp, dp, held_out = mesh.group("tp"), mesh.group("dp"), mesh.group("dp_cp")
        engine: Engine = FlatEngine(replicas[0], tp, split, dp, replicas[1:], held_out)
    else:
        engine = _pipeline_engine(model, mesh, cfg, plan, split)
    engine.rng_tracker = tracker  # saved in checkpoints: dropout resumes exactly
    engine.compiled = compiled.only(engine.modules) if compiled else None  # this stage's
    return engine


def token_split(
    model: nn.Module, plan: ModelPlan, mesh: Mesh, cfg: RunConfig, packed: bool = False
) -> TokenShard:
    """With cp > 1, make `model` context parallel over the cp group (in place) and return
    how this rank takes its tokens of a micro-batch; with cp = 1, every token (and with
    `packed`, the documents' positions)."""
    cp = mesh.group("cp")
    if cp.size == 1:
        return TokenShard(packed=packed)
    method = cfg.parallel.cp_method
    apply_context_parallel(model, plan.context_attention, plan.context_positions, cp, method)
    return dataclasses.replace(TokenShard.of(cp, method), packed=packed)


def _pipeline_engine(
    model: nn.Module, mesh: Mesh, cfg: RunConfig, plan: ModelPlan, split: TokenShard
) -> Engine:
    p, pp = cfg.parallel, mesh.group("pp")
    groups = DataGroups.of(p.dp_mode)
    shares = apply_experts(model, plan, mesh, groups)  # before the split: chunks share layers
    cuts = pipeline_plan(plan)
    tied = find_tied_weights(model, cuts)
    chunks = split_into_stages(model, pp.rank, pp.size, chunks=p.chunks, plan=cuts)
    schedule = build_schedule(p.schedule, pp.size, cfg.train.microbatches, p.chunks)
    dtype = MixedPrecision.of(compute_dtype(cfg)).param_dtype  # of messages between stages
    # Replicas sum over dp_cp, split experts over expert_dp; the engine divides every
    # gradient by the global batch's target tokens, as the flat engine does.
    (dense, dp_cp), *experts = shares
    hybrid = hybrid_groups(mesh, dense, groups)
    replicas = [data_parallel(c, dp_cp, cfg, plan, "sum", dense, hybrid) for c in chunks]
    more = [data_parallel(c, g, cfg, plan, "sum", s, hybrid_groups(mesh, s, groups))
            for s, g in experts for c in chunks if s.named(c)]  # fmt: skip
    # The saved-tensor meter costs about a tenth of a forward; only --trace reads it.
    runtime = PipelineRuntime(
        chunks,
        schedule,
        pp,
        hidden_size=cfg.model.d_model,
        dtype=dtype,
        meter=ActivationMeter if cfg.train.trace else None,
        split=split,
        keywords=split.keywords,
        stage_loss=aux_loss if cfg.model.num_experts else None,  # MoE balancing losses
        one_backward=functools.partial(one_backward, [*replicas, *more]),
    )
    ends = mesh.pipeline_ends_group() if tied else None  # collective: every rank decides alike
    dp, held_out = mesh.group("dp"), mesh.group("dp_cp")
    return PipelineEngine(
        replicas, runtime, mesh.group("tp"), tied, ends, dp, more=more, held_out=held_out
    )


def data_parallel(
    module: nn.Module,
    group: comm.CommGroup,
    cfg: RunConfig,
    plan: ModelPlan | None = None,
    reduce_op: str = "sum",
    share: ParamShare = EVERY_PARAMETER,
    hybrid: HybridGroups | None = None,
) -> Replica:
    """The wrapper the configuration asks for (see the module docstring).

    reduce_op: "sum" for losses normalised by the global token count (the flat engine),
    "avg" for per-replica mean losses (DDP's convention; the engines normalise themselves).
    share: the parameters it holds (all; or, under expert parallelism, train/experts.py).
    hybrid: HSDP's groups (`hybrid_groups`), for ZeRO 1-3 only (validate refuses the rest).
    """
    p, dtype = cfg.parallel, compute_dtype(cfg)
    plan = plan if plan is not None else plan_of(cfg)
    # --compress: refused with ZeRO-3 (validate/rules_compression.py)
    compress = compress_settings(p.compress, p.compress_rank, p.compress_start, cfg.train.seed)
    if p.zero == 0 and dtype == "float32":
        return DataParallel(module, group, p.bucket_mb, reduce_op, share=share, compress=compress)
    precision = MixedPrecision.of(dtype)
    precision = dataclasses.replace(precision, initial_loss_scale=cfg.train.loss_scale)
    cast_frozen(module, precision.param_dtype)  # a LoRA run's base: no master copy
    if p.zero == 3:  # the plan's units, less other shares' parameters; or the share's own
        units = expand_units(module, share.units or plan.fsdp_units)
        return FullyShardedDataParallel(
            module, group, units, precision, p.prefetch, reduce_op, share, hybrid
        )
    accumulate = p.zero2_accumulate if p.zero == 2 else "full"
    return ZeroDataParallel(
        module,
        group,
        p.zero,
        precision,
        p.bucket_mb,
        reduce_op=reduce_op,
        accumulate=accumulate,
        share=share,
        hybrid=hybrid,
        compress=compress,
    )
