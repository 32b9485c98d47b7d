"""Equivalence helper: a parallel run must equal plain single-process PyTorch training.

The reference below is written independently of paratrain's training code: the model
(`paratrain.models.gpt`, plain PyTorch) and `torch.optim.AdamW`, with the LR schedule
re-derived here, trained on the whole global batch at once. The parallel side is
`paratrain.train.loop.train`, exactly what `paratrain train` runs.

Compared per step: the loss and the global gradient norm (so that a reduction that sums
instead of averaging is caught even though Adam and clipping hide it from the loss);
at the end: every parameter. The helper also checks that the parameters moved, so that a
run that trains nothing cannot pass.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import textwrap
from dataclasses import dataclass
from pathlib import Path

import torch

from paratrain.config import RunConfig
from paratrain.data.document_rows import training_rows
from paratrain.data.supervised import run_row_layout
from paratrain.data.tokens import TokenData
from paratrain.token_rows import model_keywords, split_rows, target_count

# Tolerances are derived on the machine that runs the test, from a float64 reference, not
# fitted to one CPU's figures. A float32 run differs from the exact (float64) trajectory by
# rounding whose size depends on the kernels (AVX2 or AVX-512, CUDA) and on the order of
# summation, and Adam amplifies it: a weight whose gradient is near zero moves by up to lr
# whatever the rounding of its gradient. `Tolerance.measured` runs the reference in float64
# and in float32 in SPREAD_ORDERS equally valid orders (the whole batch at once, and
# accumulated over 2, 4 and 8 micro-batches: other summation orders through the same
# kernels), and takes each quantity's widest distance from float64 over those orders and
# every step: the spread. A parallel run lying within the spread of float64 would be within
# twice it of the float32 reference (both ends lie within it of float64). But a parallel
# run also computes other algorithms for the same sums (matmuls split over ranks, a
# vocabulary-parallel softmax, partial sums added across ranks), whose rounding is of the
# same kind but not bounded by the reordered batches' spread, a maximum over a few samples:
# SPREAD_FACTOR = 8 allows four times the two spreads for that. A floor of FLOOR_ULPS
# float32 units of the value covers a spread that falls near zero by chance.
SPREAD_ORDERS = (1, 2, 4, 8)
SPREAD_FACTOR = 8.0
FLOOR_ULPS = 8
FLOAT32_UNIT = 2.0**-24  # float32's unit roundoff
MIN_PARAM_MOVE = 1e-3  # the largest parameter change must exceed this


def tiny_data() -> TokenData:
    """About 20 KB of real text, the same for every test run on one Python version."""
    text = Path(textwrap.__file__).read_bytes()
    tokens = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    cut = len(tokens) * 9 // 10
    return TokenData(tokens[:cut].clone(), tokens[cut:].clone(), 256, "textwrap", "textwrap.py")


def tiny_config(**train: object) -> RunConfig:
    """A GPT small enough that a few steps in 4 processes take about a second."""
    cfg = RunConfig()
    cfg.model.n_layer, cfg.model.n_head, cfg.model.d_model = 2, 2, 32
    cfg.model.max_seq_len = 32
    t = cfg.train
    t.seq_len, t.global_batch, t.micro_batch, t.steps = 16, 8, 2, 4
    t.lr, t.warmup_steps, t.val_batches, t.grad_clip = 1e-2, 2, 2, 1.0
    for key, value in train.items():
        setattr(t, key, value)
    return cfg


@dataclass
class Tolerance:
    """How far a float32 run may be from the float32 reference: loss and grad norm
    relative, parameters absolute (see SPREAD_FACTOR above)."""

    loss_rtol: float
    norm_rtol: float
    param_atol: float

    @classmethod
    def measured(cls, exact: RunRecord, orders: list[RunRecord]) -> Tolerance:
        def spread(values: list[float], exact_values: list[float]) -> float:
            pairs = zip(values, exact_values, strict=True)
            return max((abs(v - e) / abs(e) for v, e in pairs), default=0.0)  # none: floor

        floor = FLOOR_ULPS * FLOAT32_UNIT
        loss = max(spread(r.losses, exact.losses) for r in orders)
        norm = max(spread(r.grad_norms, exact.grad_norms) for r in orders)
        whole = torch.cat([v.double().flatten() for v in exact.state.values()])
        param = max(
            spread_bound(torch.cat([r.state[k].flatten() for k in exact.state]), whole)
            for r in orders
        )
        return cls(SPREAD_FACTOR * max(loss, floor), SPREAD_FACTOR * max(norm, floor), param)


def spread_bound(values: torch.Tensor, exact: torch.Tensor) -> float:
    """What another float32 evaluation of `values` may differ from them by: their distance
    from `exact` (the same computed in float64) times SPREAD_FACTOR, at least FLOOR_ULPS
    float32 units of the largest exact value (the rule of Tolerance's parameters)."""
    spread = (values.double() - exact.double()).abs().max().item()
    floor = FLOOR_ULPS * FLOAT32_UNIT * exact.abs().max().item()
    return SPREAD_FACTOR * max(spread, floor)


@dataclass
class RunRecord:
    losses: list[float]
    grad_norms: list[float]
    state: dict[str, torch.Tensor]
    tolerance: Tolerance | None = None  # a reference's: what a run compared with it may differ


def reference_lr(step: int, cfg: RunConfig) -> float:
    t = cfg.train
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    progress = min(1.0, (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps))
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def reference_training(
    cfg: RunConfig,
    data: TokenData,
    tie_embeddings: bool = False,
    device: str = "cpu",
    orders: tuple[int, ...] = SPREAD_ORDERS,
) -> tuple[RunRecord, dict]:
    """Plain PyTorch on one process; returns the float32 record, with the tolerance that
    a run compared with it is held to (measured against float64: Tolerance), and the
    initial state (both on the CPU). On another `device` (scripts/gpu_check.py) the weights
    are still drawn on the CPU, as paratrain's `build_model` draws them, then moved with
    every batch. `orders`: the accumulation orders whose spread sets the tolerance, the
    first the record's; (1,) where micro-batches are not a reordering of the same sums (a
    mixture of experts' capacity is per micro-batch: tests/test_moe_training.py)."""
    runs = [plain_training(cfg, data, tie_embeddings, device, torch.float32, k) for k in orders]
    exact, _ = plain_training(cfg, data, tie_embeddings, device, torch.float64, 1)
    (record, initial) = runs[0]
    record.tolerance = Tolerance.measured(exact, [r for r, _ in runs])
    return record, initial


def plain_training(
    cfg: RunConfig,
    data: TokenData,
    tie_embeddings: bool,
    device: str,
    dtype: torch.dtype,
    accumulate: int,
) -> tuple[RunRecord, dict]:
    """cfg's steps in plain PyTorch, in `dtype`, each step's global batch taken in
    `accumulate` micro-batches (the loss averaged over them, as over one batch)."""
    from paratrain.models.registry import plain_model  # the model only: no training code

    t = cfg.train
    torch.manual_seed(t.seed)
    m = dataclasses.replace(cfg.model, tie_embeddings=tie_embeddings or cfg.model.tie_embeddings)
    with torch.device("cpu"):
        model = plain_model(m)  # GPT or Llama, by m.arch
    if t.lora_rank:  # the same adapters, applied from outside (frozen base: no gradient)
        from paratrain.models.plans import PLANS, lora_patterns
        from paratrain.parallel.lora import apply_lora

        patterns = lora_patterns(t.lora_targets, PLANS[m.arch])
        apply_lora(model, patterns, t.lora_rank, t.lora_alpha, t.seed)
    initial = copy.deepcopy(model.state_dict())
    model.to(device=device, dtype=dtype)
    trained = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trained if p.dim() >= 2]
    no_decay = [p for p in trained if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": t.weight_decay},
            {"params": no_decay, "weight_decay": 0},
        ],
        lr=t.lr,
        betas=(t.beta1, t.beta2),
    )
    layout = run_row_layout(cfg, data.supervised)
    sampler = training_rows(data, layout, t.seq_len, t.global_batch, t.seed)
    losses, norms = [], []
    for step in range(t.steps):
        for group in opt.param_groups:
            group["lr"] = reference_lr(step, cfg)
        batch = sampler.global_batch_at(step).to(device)
        opt.zero_grad()
        step_loss = 0.0
        parts = accumulate if len(batch) % accumulate == 0 else 1  # equal parts only
        for part in batch.chunk(parts):
            if data.supervised:  # the mean over the batch's targets: each part by its count
                if target_count(part) == 0:
                    continue
                loss = model(*split_rows(part), **model_keywords(part))
                loss = loss * (target_count(part) / target_count(batch))
            else:
                loss = model(part[:, :-1], part[:, 1:]) / parts
            loss.backward()
            step_loss += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip or float("inf"))
        opt.step()
        for m in model.modules():  # a mixture of experts' balancing bias: the model's own
            if hasattr(m, "balance_bias"):  # per-step update (models/moe.py), after the step
                m.balance_bias()
        losses.append(step_loss)
        norms.append(norm.item())
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return RunRecord(losses, norms, state), initial


class References:
    """reference_training once per distinct reference on `data`: configurations that differ
    only in what the reference does not read (the layout, micro-batching, recomputation,
    compute dtype) share one run."""

    def __init__(self, data: TokenData) -> None:
        self.data = data
        self._runs: dict[str, tuple[RunRecord, dict]] = {}

    def __call__(self, cfg: RunConfig) -> tuple[RunRecord, dict]:
        own = {"micro_batch": 1, "microbatches": 0, "recompute": "none", "dtype": "float32"}
        key = repr((cfg.model, dataclasses.replace(cfg.train, **own, loss_scale=1.0)))
        if key not in self._runs:
            self._runs[key] = reference_training(cfg, self.data)
        return self._runs[key]


def assert_equivalent(parallel: RunRecord, reference: RunRecord, initial: dict) -> None:
    """`parallel` within `reference.tolerance` (from reference_training) of `reference`."""
    tol = reference.tolerance
    assert tol is not None, "the reference carries no tolerance: use reference_training"
    assert len(parallel.losses) == len(reference.losses), "different number of steps"
    for step, (a, b) in enumerate(zip(parallel.losses, reference.losses, strict=True), start=1):
        assert math.isclose(a, b, rel_tol=tol.loss_rtol), f"step {step}: loss {a} != reference {b}"
    norms = zip(parallel.grad_norms, reference.grad_norms, strict=True)
    for step, (a, b) in enumerate(norms, start=1):
        assert math.isclose(a, b, rel_tol=tol.norm_rtol), (
            f"step {step}: grad norm {a} != reference {b} (rtol {tol.norm_rtol:.3g})"
        )
    assert parallel.state.keys() == reference.state.keys(), "different parameter names"
    moved = 0.0
    for name, ref in reference.state.items():
        diff = (parallel.state[name] - ref).abs().max().item()
        assert diff <= tol.param_atol, (
            f"parameter {name} differs from reference by {diff:.3g} > {tol.param_atol:.3g}"
        )
        moved = max(moved, (ref - initial[name]).abs().max().item())
    assert moved > MIN_PARAM_MOVE, f"parameters barely moved ({moved:.3g}): nothing was trained"


def run_steps(engine, cfg: RunConfig, data: TokenData, dp_group) -> tuple[list, list]:
    """cfg.train.steps steps of the one training step (train/step.py) through `engine`,
    each replica taking its micro-batches of the step's global batch; (losses, norms)."""
    from paratrain.train.optim import LrSchedule
    from paratrain.train.step import train_step

    t = cfg.train
    lr = LrSchedule.of(cfg)
    optimizer = engine.build_optimizer(lr.peak, t.weight_decay, (t.beta1, t.beta2))
    layout = run_row_layout(cfg, data.supervised)
    sampler = training_rows(data, layout, t.seq_len, t.global_batch, t.seed)
    losses, norms = [], []
    for step in range(t.steps):
        micro = sampler.replica_microbatches(step, dp_group.rank, dp_group.size, t.micro_batch)
        out = train_step(engine, optimizer, micro, lr(step), t.grad_clip)
        losses.append(out.loss)
        norms.append(out.grad_norm)
    return losses, norms


def record_of(result, tp_group) -> RunRecord:
    """A rank's losses, norms and whole parameters (tensor-parallel shards gathered) from
    `paratrain.train.loop.train`'s result, whatever the layout (collective over tp)."""
    from paratrain.parallel.tensor_parallel import full_state_dict

    chunks = result.model if hasattr(result.model, "__len__") else [result.model]
    state: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        state.update(full_state_dict(chunk, tp_group))
    return RunRecord([m.loss for m in result.metrics], [m.grad_norm for m in result.metrics], state)


def run_and_record(rank: int, world: int, cfg: RunConfig, run_dir: str, resume_step: int):
    """cfg's run saving into `run_dir` (from its checkpoint of `resume_step`, if given):
    this rank's losses, norms and whole parameters (run_distributed's function)."""
    from paratrain import checkpoint as ck
    from paratrain.mesh import Mesh
    from paratrain.train.loop import train

    p = cfg.parallel
    mesh = Mesh.build(dp=p.dp, pp=p.pp, tp=p.tp, replicas=p.replicas)
    resume = None
    if resume_step:
        resume = ck.Checkpoint(ck.checkpoint_path(Path(run_dir), resume_step), resume_step)
    result = train(cfg, mesh, tiny_data(), run_dir=Path(run_dir), resume=resume)
    record = record_of(result, mesh.group("tp"))
    mesh.close()
    return record


def assert_layout_equivalent(
    records: list[RunRecord],
    cfg: RunConfig,
    data: TokenData,
    clip: float | None = None,
    references: References | None = None,
) -> None:
    """Every rank's record of one layout against the reference: the stages' parameters put
    together, losses and norms reported identically on every rank."""
    reference, initial = (references or References(data))(cfg)
    if clip is not None:
        assert all(n > clip for n in reference.grad_norms), "clipping must be active"
    state: dict[str, torch.Tensor] = {}
    for record in records:
        state.update(record.state)
    assert_equivalent(
        RunRecord(records[0].losses, records[0].grad_norms, state), reference, initial
    )
    for record in records:
        assert record.losses == records[0].losses
        assert record.grad_norms == records[0].grad_norms


def train_layouts(rank, world_size, runs, data) -> list[RunRecord]:
    """In each of world_size processes: train every (dp, pp, tp, cfg) of `runs` in turn
    through `paratrain.train.loop.train` and return this rank's records, in order. The
    mesh's collectives run cfg's --comm-algo, as in `paratrain train` (train/worker.py)."""
    from paratrain.comm import CommOptions
    from paratrain.mesh import Mesh
    from paratrain.train.loop import train

    records = []
    for dp, pp, tp, cfg in runs:
        options = CommOptions(algo=cfg.parallel.comm_algo)
        p = cfg.parallel
        mesh = Mesh.build(dp=dp, pp=pp, tp=tp, cp=p.cp, options=options, replicas=p.replicas)
        records.append(record_of(train(cfg, mesh, data), mesh.group("tp")))
    return records


def check_layouts(world: int, configs: list[RunConfig], clip: float) -> None:
    """Train every resolved config in `world` processes and check each against one process."""
    from tests.distributed import run_distributed

    data = tiny_data()
    runs = [(c.parallel.dp, c.parallel.pp, c.parallel.tp, c) for c in configs]
    per_rank = run_distributed(train_layouts, world, runs, data, timeout=600)
    references = References(data)
    for i, cfg in enumerate(configs):
        try:
            assert_layout_equivalent([r[i] for r in per_rank], cfg, data, clip, references)
        except AssertionError as e:
            e.add_note(f"layout {i} of {len(configs)}: {cfg.parallel}, {cfg.train.recompute=}")
            raise
