"""Every check on user input, run by the CLI before any worker starts.

Each failure is a ValueError whose one-line message names the flag and what would be
valid; the CLI prints it and exits with status 2. Filling in the automatic fields is
config.resolve (it refuses nothing); checking is here:

- field_checks.py: what each field's facts imply (finite, one of its choices, in range);
- rules_*.py: the combination rules, one file per concern (devices, layout, pipeline,
  model, sharding, experts, compile, data), run in check.py's order;
- effective.py: a flag given where it changes nothing (config.EFFECTS).

Training code never imports it (tests/test_layering.py): a worker gets a checked config.
"""

from paratrain.validate.check import RULES, check, resolve_and_check
from paratrain.validate.effective import check_effective

__all__ = ["RULES", "check", "check_effective", "resolve_and_check"]
