"""What a configuration field knows about itself.

`param(default, help, choices=..., at_least=..., effect=...)` returns a dataclass field whose
metadata carries its `Facts`: the help text, the valid values, the range, when it has an
effect and its flag. The membership and range checks (validate/field_checks.py), the
`EFFECTS` table, the `--help` lines and the generated docs all read them, so a new field
states each fact once, beside its default.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import Field, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Effect:
    """When a field changes what a run does, on the resolved configuration."""

    applies: Callable[[Any], bool]  # RunConfig -> bool (config/run.py holds RunConfig)
    needs: str  # the setting it needs, in flags


@dataclass(frozen=True)
class Facts:
    """One field's facts. Bounds are inclusive (at_least, at_most) or not (above, below);
    a check written `not value >= bound` refuses NaN too."""

    help: str
    choices: tuple[Any, ...] | None = None
    at_least: float | None = None
    above: float | None = None
    at_most: float | None = None
    below: float | None = None
    effect: Effect | None = None  # None: it always matters
    flag: str | None = None  # None: --name-with-dashes
    default_means: str | None = None  # the default in words, where its value says little
    repeatable: bool = False  # a comma-separated list that each use of the flag adds to


_FACTS = "paratrain"  # the metadata key


def param(default: Any, help: str, **facts: Any) -> Any:
    """A dataclass field carrying its facts: `help` becomes its `--help` line (keywords:
    those of `Facts`)."""
    return field(default=default, metadata={_FACTS: Facts(help, **facts)})


def facts_of(f: Field[Any]) -> Facts:
    return f.metadata[_FACTS]


def flag_name(name: str, facts: Facts) -> str:
    return facts.flag or "--" + name.replace("_", "-")


def in_range(facts: Facts, value: float) -> bool:
    """Within every bound the facts give (written so that NaN is never within)."""
    checks = [
        (facts.at_least, lambda b: value >= b),
        (facts.above, lambda b: value > b),
        (facts.at_most, lambda b: value <= b),
        (facts.below, lambda b: value < b),
    ]
    return all(test(bound) for bound, test in checks if bound is not None)


def range_words(facts: Facts) -> str | None:
    """The range as a refusal reads it: 'positive', 'at least 1', 'in [0, 1)'; None when
    the field has no bound."""
    low = (facts.at_least, "[") if facts.at_least is not None else (facts.above, "(")
    high = (facts.at_most, "]") if facts.at_most is not None else (facts.below, ")")
    if low[0] is None and high[0] is None:
        return None
    if low[0] is not None and high[0] is not None:
        return f"in {low[1]}{low[0]}, {high[0]}{high[1]}"
    if high[0] is not None:
        return f"at most {high[0]}" if high[1] == "]" else f"below {high[0]}"
    if low == (0, "("):
        return "positive"
    if low == (0, "["):
        return "0 or more"
    return f"at least {low[0]}" if low[1] == "[" else f"above {low[0]}"


def one_of(values: tuple[Any, ...]) -> str:
    """'a, b or c': the choices as a sentence reads them."""
    words = [str(v) for v in values]
    return ", ".join(words[:-1]) + " or " + words[-1]
