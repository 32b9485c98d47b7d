"""Refusing a flag that changes nothing in this configuration (config.EFFECTS says when a
field has an effect; each field's `param(..., effect=...)` states it)."""

from __future__ import annotations

from paratrain.config import EFFECTS, FIELDS, RunConfig


def check_effective(cfg: RunConfig, given: dict[str, str]) -> None:
    """Refuse a field given explicitly (`given`: 'section.name' -> its flag, or "in FILE") with
    a value other than its default where it has no effect."""
    for key, how in given.items():
        effect, entry = EFFECTS[key], FIELDS[key]
        value = entry.value(cfg)
        if effect is None or effect.applies(cfg) or value == entry.default:
            continue
        if not how.startswith("--"):
            given_as = f"{key} = {value!r} {how}"
        elif isinstance(value, bool):
            given_as = how if value else f"--no-{how[2:]}"
        else:
            given_as = f"{how} {value}"
        raise ValueError(f"{given_as} has no effect here: it needs {effect.needs}")
