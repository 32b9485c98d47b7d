"""Rules on the model's shape: a known preset, fields of the other architecture left alone,
heads that divide the width, sequences that fit the model."""

from __future__ import annotations

from paratrain.config import ARCHS, RunConfig, flag_for
from paratrain.models.presets import preset

# Fields that only one architecture reads, with the value the other must keep.
ARCH_ONLY = {
    "gpt": {"n_kv_head": 0, "ffn_hidden": 0, "rope_theta": 10000.0, "norm_eps": 1e-5},
    "llama": {"dropout": 0.0, "activation": "gelu"},
}


def model_rules(cfg: RunConfig) -> None:
    m = cfg.model
    preset(m.name)  # a known preset (its fields are the defaults the others override)
    for name, value in ARCH_ONLY[m.arch].items():
        if getattr(m, name) != value and not (name == "n_kv_head" and m.n_kv_head == m.n_head):
            other = next(a for a in ARCHS if a != m.arch)
            raise ValueError(
                f"{flag_for('model', name)} {getattr(m, name)!r} applies to --arch {other} "
                f"only; this model is {m.arch} (leave it at {value!r})"
            )
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
