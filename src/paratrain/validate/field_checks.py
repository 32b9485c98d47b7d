"""The checks every field's facts imply, on any field that states them: a finite number,
one of its choices, within its range. Each refusal is one line naming the flag and what
would be valid; a new field with `choices=` or `at_least=` is checked without a line here."""

from __future__ import annotations

import math

from paratrain.config import RunConfig, every_field
from paratrain.config.fields import in_range, range_words


def check_fields(cfg: RunConfig) -> None:
    for entry in every_field():
        value, facts, flag = entry.value(cfg), entry.facts, entry.flag
        # NaN compares false with everything; the range checks refuse it, and infinities
        # where a bound is missing, but "finite" says more than "in [0, 1)".
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{flag} {value} must be a finite number")
        if facts.choices is not None and value not in facts.choices:
            valid = ", ".join(map(str, facts.choices))
            raise ValueError(f"{flag} {value!r}; valid: {valid}")
        if not isinstance(value, bool) and not in_range(facts, value):
            raise ValueError(f"{flag} {value} must be {range_words(facts)}")
