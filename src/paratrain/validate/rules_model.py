"""Rules on the model's shape: a known preset, fields of the other architecture left alone,
heads that divide the width, sequences that fit the model."""

from __future__ import annotations

from paratrain.config import FIELDS, RunConfig
from paratrain.config.conditions import GPT, LLAMA
from paratrain.models.presets import preset

# The fields only one architecture reads, from their effect facts: 'model.rope_theta' ->
# 'llama'. The other architecture must leave them at their defaults.
_OWNERS = {LLAMA: "llama", GPT: "gpt"}
ARCH_ONLY = {key: _OWNERS[e.facts.effect] for key, e in FIELDS.items() if e.facts.effect in _OWNERS}


def model_rules(cfg: RunConfig) -> None:
    m = cfg.model
    preset(m.name)  # a known preset (its fields are the defaults the others override)
    _other_architectures_fields_left_alone(cfg)
    if m.n_head % (m.n_kv_head or m.n_head):
        raise ValueError(
            f"--n-kv-head {m.n_kv_head} does not divide --n-head {m.n_head}; "
            "each key/value head serves a whole group of query heads"
        )
    if m.d_model % m.n_head != 0:
        raise ValueError(
            f"--n-head {m.n_head} does not divide --d-model {m.d_model}; "
            f"choose a divisor of {m.d_model}"
        )
    if cfg.train.seq_len > m.max_seq_len:
        raise ValueError(
            f"--seq-len {cfg.train.seq_len} exceeds --max-seq-len {m.max_seq_len}; "
            f"use at most {m.max_seq_len} or raise --max-seq-len"
        )


def _other_architectures_fields_left_alone(cfg: RunConfig) -> None:
    """Checked on every value, not only those given now: --init-from's model, a resumed
    run's config.toml (check_effective sees only the flags and --config's keys)."""
    m = cfg.model
    for key, arch in ARCH_ONLY.items():
        entry = FIELDS[key]
        value = entry.value(cfg)
        plain_attention = key == "model.n_kv_head" and value == m.n_head  # as many kv heads
        if arch != m.arch and value != entry.default and not plain_attention:
            raise ValueError(
                f"{entry.flag} {value!r} applies to --arch {arch} only; this model is "
                f"{m.arch} (leave it at {entry.default!r})"
            )
