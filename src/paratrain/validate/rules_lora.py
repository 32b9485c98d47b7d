"""Rules on LoRA (--lora-rank, parallel/lora.py): the layouts it trains under so far, and
targets that name linear layers the rank fits, each refusal one line naming the flag and
what would be valid (docs/models.md)."""

from __future__ import annotations

from paratrain.config import RunConfig
from paratrain.models.plans import PLANS, lora_patterns


def lora_rules(cfg: RunConfig) -> None:
    t = cfg.train
    if t.lora_rank == 0:
        return
    refusal = _layout_refusal(cfg)
    if refusal:
        raise ValueError(f"--lora-rank {t.lora_rank} with {refusal}")
    # The layers' names and sizes, from the model built on the meta device (no memory);
    # torch is loaded only here, for a LoRA run, which loads it to train anyway.
    import torch

    from paratrain.models import registry
    from paratrain.parallel.lora import lora_targets

    with torch.device("meta"):
        model = registry.plain_model(cfg.model)
    lora_targets(model, lora_patterns(t.lora_targets, PLANS[cfg.model.arch]), t.lora_rank)


def _layout_refusal(cfg: RunConfig) -> str | None:
    """What LoRA does not combine with yet, in words; None when it does."""
    p, m = cfg.parallel, cfg.model
    if p.dp_mode == "async":
        return "--dp-mode async: the parameter server trains every parameter; use --dp-mode sync"
    if m.num_experts:
        return (
            f"--num-experts {m.num_experts}: LoRA on a mixture of experts' stacked experts is "
            "not implemented; use a dense model"
        )
    if cfg.train.optimizer == "muon":
        return (
            "--optimizer muon: Muon's matrices are the frozen base weights, the adapters "
            "would all fall to AdamW; use --optimizer adamw"
        )
    return None
