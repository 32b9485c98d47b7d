"""Rules on --optimizer: the layouts Muon runs under so far, each refusal one line naming
the flag and what would be valid (docs/optimizers.md)."""

from __future__ import annotations

from paratrain.config import RunConfig
from paratrain.models.plans import PLANS


def optimizer_rules(cfg: RunConfig) -> None:
    p = cfg.parallel
    if cfg.train.optimizer != "muon":
        return
    if p.dp_mode == "async":
        raise ValueError(
            "--optimizer muon with --dp-mode async: the parameter server runs AdamW; "
            "use --dp-mode sync or --optimizer adamw"
        )
    if not PLANS[cfg.model.arch].muon_matrices:
        raise ValueError(
            f"--optimizer muon: the {cfg.model.arch} model plan names no hidden matrix for "
            "Muon (models/plans.py: muon_matrices); use --optimizer adamw"
        )
