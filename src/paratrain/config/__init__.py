"""Run configuration: dataclasses whose fields carry their own facts, and when each matters.

Precedence is CLI flag > TOML file > default. For example, with `run.toml` holding
`[train]\\nsteps = 50` the command `paratrain train --config run.toml --steps 80` runs 80
steps, and without `--steps` it runs 50.

- fields.py: `param(default, help, choices=..., at_least=..., effect=...)`, a field's facts;
- choices.py: every set of valid values; conditions.py: the settings several fields need;
- model_fields.py, parallel_fields.py (with parallel_config.py, fault tolerance's),
  train_fields.py: the sections [model], [parallel], [train] and [data];
- run.py: RunConfig, `EFFECTS` and each field's flag, from the facts;
- resolution.py: `resolve`, the automatic fields filled in (pure; it refuses nothing).

Adding a field is one line in its section, with its facts:

    prefetch: int = param(1, "ZeRO-3: units gathered ahead of the one computing.",
                          at_least=0, effect=Effect(lambda c: c.parallel.zero == 3, "--zero 3"))

gives the flag --prefetch with that help and its default, the range check (a refusal
naming --prefetch), the TOML key [parallel] prefetch, and the refusal of --prefetch 2
without --zero 3. A rule between fields goes in validate/rules_<concern>.py.

Every check on user input is paratrain/validate/ (the CLI runs it before any worker
starts); reading and writing TOML is toml_file.py. A leaf: imports nothing from paratrain.
"""

from paratrain.config.choices import (
    ARCHS,
    AUTO,
    BACKENDS,
    COMM_ALGOS,
    COMM_ORDERS,
    COMPUTE_DTYPES,
    CP_METHODS,
    DC_MODES,
    DEVICES,
    DP_MODES,
    DTYPE_SHORT_NAMES,
    GELUS,
    LR_SCALINGS,
    RECOMPUTE_MODES,
    SCHEDULES,
    ZERO2_ACCUMULATE,
    ZERO_STAGES,
)
from paratrain.config.fields import Effect, Facts, one_of, param
from paratrain.config.model_fields import ModelConfig
from paratrain.config.parallel_config import ParallelConfig
from paratrain.config.resolution import resolve
from paratrain.config.run import (
    EFFECTS,
    FIELDS,
    SECTIONS,
    FieldEntry,
    RunConfig,
    compute_dtype,
    device_type,
    every_field,
    flag_for,
    parse_straggler,
)
from paratrain.config.train_fields import DataConfig, TrainConfig

__all__ = [
    "ARCHS", "AUTO", "BACKENDS", "COMM_ALGOS", "COMM_ORDERS", "COMPUTE_DTYPES", "CP_METHODS",
    "DC_MODES", "DEVICES", "DP_MODES", "DTYPE_SHORT_NAMES", "EFFECTS", "FIELDS", "GELUS",
    "LR_SCALINGS", "RECOMPUTE_MODES", "SCHEDULES", "SECTIONS", "ZERO2_ACCUMULATE",
    "ZERO_STAGES", "DataConfig", "Effect", "Facts", "FieldEntry", "ModelConfig",
    "ParallelConfig", "RunConfig", "TrainConfig", "compute_dtype", "device_type",
    "every_field", "flag_for", "one_of", "param", "parse_straggler", "resolve",
]  # fmt: skip
