"""Rules on --data and --tokenizer that need no reading of the data (data/checks.py reads
it, once, before any worker starts)."""

from __future__ import annotations

from pathlib import Path

from paratrain.config import RunConfig


def data_rules(cfg: RunConfig) -> None:
    path = cfg.data.path
    if path and not Path(path).exists():
        raise ValueError(f"--data {path!r} does not exist; give a text file, a folder or a .bin")
    if cfg.data.tokenizer and path.endswith(".bin"):
        raise ValueError(
            f"--tokenizer with --data {path!r}: a .bin holds token ids already; leave one out"
        )
    ids: str | bool = (path and path.endswith(".bin")) or cfg.data.tokenizer
    ids = ids or (path and (Path(path) / "meta.json").is_file())  # a prepared directory
    if not ids and cfg.model.vocab_size < 256:
        raise ValueError(
            f"--vocab-size {cfg.model.vocab_size} is too small for byte-level text; "
            "use at least 256"
        )
