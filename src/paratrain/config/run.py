"""The whole run configuration: its four sections, every field with its facts, and the
facts' tables (`EFFECTS`, each field's flag)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

from paratrain.config.conditions import world
from paratrain.config.fields import Effect, Facts, facts_of, flag_name
from paratrain.config.model_fields import ModelConfig
from paratrain.config.parallel_config import ParallelConfig
from paratrain.config.train_fields import DataConfig, TrainConfig


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)

    @property
    def world_size(self) -> int:
        return world(self)

    @property
    def tokens_per_step(self) -> int:
        return self.train.global_batch * self.train.seq_len


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "train": TrainConfig,
    "data": DataConfig,
}


@dataclass(frozen=True)
class FieldEntry:
    """One field of RunConfig: where it sits, its default, its facts and its flag."""

    section: str
    name: str
    kind: type  # int, float, str or bool
    default: Any
    facts: Facts

    @property
    def key(self) -> str:  # 'section.name', as TOML and EFFECTS spell it
        return f"{self.section}.{self.name}"

    @property
    def flag(self) -> str:
        return flag_name(self.name, self.facts)

    def value(self, cfg: RunConfig) -> Any:
        return getattr(getattr(cfg, self.section), self.name)


_KINDS = {"int": int, "float": float, "str": str, "bool": bool}  # annotations are strings


def every_field() -> Iterator[FieldEntry]:
    for section, cls in SECTIONS.items():
        for f in fields(cls):
            yield FieldEntry(section, f.name, _KINDS[str(f.type)], f.default, facts_of(f))


# Read-only views: tables computed once from the facts, never changed at run time.
FIELDS: Mapping[str, FieldEntry] = MappingProxyType({e.key: e for e in every_field()})


def flag_for(section: str, name: str) -> str:
    """The command-line flag of [section] name: --name-with-dashes unless its facts say."""
    return FIELDS[f"{section}.{name}"].flag


# Every field: None when it always matters, else when it does. A field given explicitly
# (flag or TOML) with a value other than its default, in a configuration where it has no
# effect, is refused before any worker starts (validate.check_effective).
EFFECTS: Mapping[str, Effect | None] = MappingProxyType(
    {key: entry.facts.effect for key, entry in FIELDS.items()}
)


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
