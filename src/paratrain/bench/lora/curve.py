"""A fine-tuning run, both ways: a base pre-trained on the default data, then fine-tuned
in full and with LoRA on supervised rows made from the same data (each line of source a
prompt, the next line its completion: only the completion is scored), the held-out
completions' loss every `every` steps. Recorded, not asserted. One process: the step
`paratrain train` builds, `train_step`, the learning-rate schedule as configured."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch

from paratrain.config import RunConfig
from paratrain.data.document_rows import training_rows, validation_rows
from paratrain.data.tokens import BatchSampler, TokenData, validation_batches
from paratrain.mesh import Mesh
from paratrain.models.plans import lora_patterns
from paratrain.parallel.lora import apply_lora
from paratrain.token_rows import as_not_targets
from paratrain.train.build import build_engine, build_model, plan_of
from paratrain.train.optim import LrSchedule, peak_lr
from paratrain.train.step import train_step

NEWLINE = 10  # the byte that ends a line


def line_pairs(tokens: torch.Tensor, longest: int) -> tuple[torch.Tensor, np.ndarray]:
    """Consecutive non-empty lines of at most `longest` bytes as (prompt, completion)
    documents, the prompt stored as no target: (ids, each document's length)."""
    ids = tokens.long()
    ends = (ids == NEWLINE).nonzero().flatten().tolist()
    lines = [ids[a + 1 : b + 1] for a, b in zip([-1, *ends], ends, strict=False)]
    lines = [line for line in lines if 1 < len(line) <= longest]
    pairs = zip(lines[::2], lines[1::2], strict=False)  # an odd last line has no completion
    docs = [torch.cat([as_not_targets(p), c]) for p, c in pairs]
    if not docs:
        raise ValueError(f"the data has no two lines of 2 to {longest} bytes: no example")
    return torch.cat(docs), np.array([len(d) for d in docs], dtype=np.int64)


def supervised_lines(data: TokenData, seq_len: int) -> TokenData:
    (train, train_docs), (val, val_docs) = (
        line_pairs(split, seq_len // 2) for split in (data.train, data.val)
    )
    documents = {"train": train_docs, "val": val_docs}
    return TokenData(train, val, data.vocab_size, "lines", "line pairs", documents, True)


def _train(
    cfg: RunConfig, engine: Any, sampler: Any, held_out: list[torch.Tensor], every: int
) -> list[tuple[int, float]]:
    t = cfg.train
    optimizer = engine.build_optimizer(peak_lr(cfg), t.weight_decay, (t.beta1, t.beta2))
    schedule, curve = LrSchedule.of(cfg), [(0, engine.evaluate(held_out))]
    for step in range(t.steps):
        batch = sampler.global_batch_at(step)
        train_step(engine, optimizer, list(batch.split(t.micro_batch)), schedule(step), t.grad_clip)
        if (step + 1) % every == 0 or step + 1 == t.steps:
            curve.append((step + 1, engine.evaluate(held_out)))
    return curve


def fine_tune_curves(
    cfg: RunConfig, data: TokenData, base_steps: int, every: int, lora_lr_scale: float
) -> dict[str, Any]:
    """The base's pre-training, then both fine-tunes from its weights (LoRA's at
    `lora_lr_scale` times the learning rate): held-out curves."""
    t = cfg.train
    pre = copy.deepcopy(cfg)
    pre.train.steps, pre.train.lora_rank = base_steps, 0
    engine = build_engine(pre, mesh=Mesh.build(dp=1))
    stream = BatchSampler(data.train, t.seq_len, t.global_batch, t.seed)
    windows = validation_batches(data.val, t.seq_len, t.micro_batch, t.val_batches)
    base_curve = _train(pre, engine, stream, windows, base_steps)
    base = {n: p.detach().clone() for n, p in engine.replicas[0].module.state_dict().items()}
    sft = supervised_lines(data, t.seq_len)
    rows = training_rows(sft, "documents", t.seq_len, t.global_batch, t.seed)
    held_out = validation_rows(sft, "documents", t.seq_len, t.micro_batch, t.val_batches)
    curves = {}
    for name, rank in (("full", 0), ("lora", cfg.train.lora_rank)):
        run = copy.deepcopy(cfg)
        run.train.lora_rank = rank
        run.train.lr *= lora_lr_scale if rank else 1.0
        model = _base_model(run, base)
        curves[name] = _train(run, build_engine(run, Mesh.build(dp=1), model=model), rows,
                              held_out, every)  # fmt: skip
    documents = sft.documents or {}
    return {"base": base_curve, "curves": curves, "documents": len(documents["train"])}


def _base_model(cfg: RunConfig, base: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The plain model with the base's weights, then LoRA's adapters as build_model
    applies them after --init-from's weights."""
    t = cfg.train
    plain = copy.deepcopy(cfg)
    plain.train.lora_rank = 0
    model = build_model(plain)
    model.load_state_dict(base)
    if t.lora_rank:
        apply_lora(
            model, lora_patterns(t.lora_targets, plan_of(cfg)), t.lora_rank, t.lora_alpha, t.seed
        )
    return model
