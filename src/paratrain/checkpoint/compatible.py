"""Whether a checkpoint can continue this run, checked before any worker starts: its files
whole against its index, the same model, the same global batch, sequence length and
--dp-mode. A damaged or foreign checkpoint is refused, never silently skipped."""

from __future__ import annotations

import pickle
from dataclasses import asdict
from pathlib import Path
from typing import Any

from paratrain.checkpoint.planner import CheckpointMismatch
from paratrain.checkpoint.store import (
    COMMIT_FILE,
    RESUMED,
    Checkpoint,
    latest_checkpoint,
    read_meta,
)
from paratrain.config import RunConfig


def check_files(path: Path) -> None:
    """Refuse a checkpoint whose index is unreadable or whose shard files are truncated.

    DCP reads byte ranges at load time; a short file would fail deep inside the load on
    some rank. Checking every range's end against the file sizes first gives one clear
    message before any worker starts.
    """
    try:
        with (path / COMMIT_FILE).open("rb") as f:
            metadata = pickle.load(f)
        storage = metadata.storage_data
    except Exception as e:  # pickle raises many kinds on a damaged file
        raise ValueError(f"checkpoint {path} has a damaged {COMMIT_FILE} ({e})") from None
    needed: dict[str, int] = {}
    for info in storage.values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, end in sorted(needed.items()):
        file = path / name
        size = file.stat().st_size if file.is_file() else -1
        if size < end:
            what = "is missing" if size < 0 else f"has {size} bytes, the index needs {end}"
            raise ValueError(f"checkpoint {path} is damaged: {name} {what}")


# What a checkpoint that does not record a field was saved with (older checkpoints).
SAVED_BEFORE = {"optimizer": "adamw", "lora_rank": 0, "lora_alpha": 16.0, "lora_targets": ""}


def check_compatible(
    meta: dict[str, Any], cfg: RunConfig, path: Path, train: tuple[str, ...] = RESUMED
) -> None:
    """The checkpoint must be of this model, and (to resume: `train` not empty) trained
    with this global batch and sequence length, in the same --dp-mode."""
    problems = []
    for key, value in asdict(cfg.model).items():
        if key in meta["model"] and meta["model"][key] != value:
            problems.append(f"model.{key} = {value} but the checkpoint has {meta['model'][key]}")
    for key in train:
        saved, now = meta["train"].get(key, SAVED_BEFORE.get(key)), getattr(cfg.train, key)
        if saved is not None and saved != now:
            problems.append(f"train.{key} = {now} but the checkpoint has {saved}")
    if train:
        problems += _mode_problems(meta, cfg)
    if problems:
        raise CheckpointMismatch(
            f"checkpoint {path} does not match this run: " + "; ".join(problems)
        )


def _mode_problems(meta: dict[str, Any], cfg: RunConfig) -> list[str]:
    """A run resumes in the mode that saved it: the model state is the same, but a
    synchronous step is one update of G sequences and an asynchronous one W updates of
    G / W, and only the parameter server's checkpoint says which batches were in flight.
    An asynchronous run resumes with as many workers: a batch index means (step, part)
    for its number of workers (train/async_loop.py)."""
    saved, now = meta.get("dp_mode", "sync"), cfg.parallel.dp_mode  # before: sync only
    if saved != now:
        return [
            f"parallel.dp_mode = {now} but the checkpoint has {saved} (a run resumes in the "
            f"mode that saved it; --init-from starts a {now} run from its weights)"
        ]
    if now == "diloco":
        p, saved_groups = cfg.parallel, meta["diloco"]
        if saved_groups != {"replicas": p.replicas, "outer_momentum": p.outer_momentum > 0}:
            return [
                f"parallel.replicas = {p.replicas}, parallel.outer_momentum = "
                f"{p.outer_momentum} but the DiLoCo checkpoint has {saved_groups['replicas']} "
                "replica groups (each with its own optimizer state) and outer momentum "
                f"{'on' if saved_groups['outer_momentum'] else 'off'}: resume with them"
            ]
    if now == "async" and meta["layout"]["dp"] != cfg.parallel.dp:
        workers, saved = cfg.parallel.dp - 1, meta["layout"]["dp"] - 1
        return [
            f"parallel.dp = {cfg.parallel.dp} ({workers} worker(s) beside the server) but "
            f"the asynchronous checkpoint has {saved} worker(s); resume on "
            f"{meta['layout']['world_size']} processes"
        ]
    return []


def find_resumable(run_dir: Path, cfg: RunConfig) -> Checkpoint | None:
    """The latest complete checkpoint, checked (files whole, same model); None if there is
    none. ValueError if it is damaged or of another model: never fall back silently."""
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        return None
    check_files(ckpt.path)
    check_compatible(read_meta(ckpt.path), cfg, ckpt.path)
    return ckpt
