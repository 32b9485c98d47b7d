"""Module-name patterns: the one grammar in which every model plan (models/plans.py) names
modules, for tensor parallelism, FSDP units, recomputation, compilation, context
parallelism and the mixture-of-experts layers.

A pattern is a dotted module name (as `model.named_modules()` gives it) in which `*` stands
for exactly one name component: "blocks.*.mlp.fc" names the fc of every block's mlp,
"blocks.*" every block. It matches whole names only, never the root module. A leaf: it
imports nothing from paratrain, so strategies and models both use it.
"""

from __future__ import annotations

import re

from torch import nn


def pattern_regex(pattern: str) -> re.Pattern[str]:
    """The regular expression of `pattern`: `*` is one component, the rest literal."""
    return re.compile("[^.]+".join(re.escape(part) for part in pattern.split("*")) + "$")


def matching(model: nn.Module, pattern: str) -> list[str]:
    """The names of `model`'s modules that `pattern` matches, in `named_modules` order."""
    regex = pattern_regex(pattern)
    return [name for name, _ in model.named_modules() if name and regex.match(name)]
