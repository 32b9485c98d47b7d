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
from paratrain.train.data import BatchSampler, TokenData

# float32: data-parallel averaging adds the same numbers in a different order than one big
# batch, so losses and gradient norms agree to rounding: measured at most 2e-7 relative
# (dp 2 and 4, K 1 to 2, 4 steps). Parameters differ more, because Adam divides by
# sqrt(v): a weight whose gradient is near zero moves by up to lr whatever the rounding of
# its gradient. Measured at most 5e-5 with lr 1e-2 (0.5% of one step); bound 2e-4.
LOSS_RTOL = 2e-6
GRAD_NORM_RTOL = 2e-6
PARAM_ATOL = 2e-4
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
class RunRecord:
    losses: list[float]
    grad_norms: list[float]
    state: dict[str, torch.Tensor]


def reference_lr(step: int, cfg: RunConfig) -> float:
    t = cfg.train
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    progress = min(1.0, (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps))
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def reference_training(
    cfg: RunConfig, data: TokenData, tie_embeddings: bool = False, device: str = "cpu"
) -> tuple[RunRecord, dict]:
    """Plain PyTorch on one process; returns the record and the initial state (both on
    the CPU). On another `device` (scripts/gpu_check.py) the weights are still drawn on the
    CPU, as paratrain's `build_model` draws them, then moved with every batch."""
    from paratrain.models.registry import plain_model  # the model only: no training code

    t = cfg.train
    torch.manual_seed(t.seed)
    m = dataclasses.replace(cfg.model, tie_embeddings=tie_embeddings or cfg.model.tie_embeddings)
    with torch.device("cpu"):
        model = plain_model(m)  # GPT or Llama, by m.arch
    initial = copy.deepcopy(model.state_dict())
    model.to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": t.weight_decay},
            {"params": no_decay, "weight_decay": 0},
        ],
        lr=t.lr,
        betas=(t.beta1, t.beta2),
    )
    sampler = BatchSampler(data.train, t.seq_len, t.global_batch, t.seed)
    losses, norms = [], []
    for step in range(t.steps):
        for group in opt.param_groups:
            group["lr"] = reference_lr(step, cfg)
        batch = sampler.global_batch_at(step).to(device)
        opt.zero_grad()
        loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip or float("inf"))
        opt.step()
        losses.append(loss.item())
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
    assert len(parallel.losses) == len(reference.losses), "different number of steps"
    for step, (a, b) in enumerate(zip(parallel.losses, reference.losses, strict=True), start=1):
        assert math.isclose(a, b, rel_tol=LOSS_RTOL), f"step {step}: loss {a} != reference {b}"
    norms = zip(parallel.grad_norms, reference.grad_norms, strict=True)
    for step, (a, b) in enumerate(norms, start=1):
        assert math.isclose(a, b, rel_tol=GRAD_NORM_RTOL), (
            f"step {step}: grad norm {a} != reference {b}"
        )
    assert parallel.state.keys() == reference.state.keys(), "different parameter names"
    moved = 0.0
    for name, ref in reference.state.items():
        diff = (parallel.state[name] - ref).abs().max().item()
        assert diff <= PARAM_ATOL, f"parameter {name} differs from reference by {diff:.3g}"
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
    sampler = BatchSampler(data.train, t.seq_len, t.global_batch, t.seed)
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
        mesh = Mesh.build(dp=dp, pp=pp, tp=tp, cp=cfg.parallel.cp, options=options)
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
