"""Configurations as TOML: read a file, apply its sections (or the CLI's) with their types
checked, write a run's resolved configuration."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

import tomli_w

from paratrain.config.run import FIELDS, SECTIONS, RunConfig


def _check_type(where: str, value: Any, expected: type) -> Any:
    # TOML integers are accepted where a float is expected; bool is not an int here.
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, bool) != (expected is bool) or not isinstance(value, expected):
        raise ValueError(
            f"{where} = {value!r} has type {type(value).__name__}; expected {expected.__name__}"
        )
    return value


def apply_overrides(cfg: RunConfig, values: dict[str, dict[str, Any]], origin: str) -> None:
    """Set `values[section][key]` on cfg, refusing unknown sections, keys and wrong types."""
    for section, entries in values.items():
        if section not in SECTIONS:
            raise ValueError(f"{origin}: unknown section [{section}]; valid: {', '.join(SECTIONS)}")
        if not isinstance(entries, dict):
            raise ValueError(f"{origin}: {section} must be a table like [{section}]")
        types = {e.name: e.kind for e in FIELDS.values() if e.section == section}
        target = getattr(cfg, section)
        for key, value in entries.items():
            if key not in types:
                valid = ", ".join(types)
                raise ValueError(f"{origin}: unknown key {section}.{key}; valid keys: {valid}")
            setattr(target, key, _check_type(f"{origin}: {section}.{key}", value, types[key]))


def load_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"config file {str(p)!r} does not exist")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config file {str(p)!r} is not valid TOML: {e}") from None


def to_toml(cfg: RunConfig) -> str:
    return tomli_w.dumps(dataclasses.asdict(cfg))


def from_toml_text(text: str) -> RunConfig:
    cfg = RunConfig()
    apply_overrides(cfg, tomllib.loads(text), "config")
    return cfg
