"""Sharded checkpoints with torch.distributed.checkpoint: save, find, check, load.

Layout of a run directory's checkpoints:

    RUN_DIR/checkpoints/step_0000020/
        paratrain.json        # step, layout, model config, data fingerprint (written first)
        __0_0.distcp ...      # each rank's boxes (about 1/k of the state per rank)
        .metadata             # DCP's index, renamed into place last: the commit point

Each checkpoint goes to a fresh directory, never over an old one; a directory without
`.metadata` is a save that did not finish and is ignored (and removed by the next save).
The last `keep` complete checkpoints are kept.

What is saved: every parameter (fp32: the master copy under mixed precision) and AdamW's
two moments per parameter, as global tensors under the plain model's names, and the
model's persistent buffers (a router's balancing bias; state.py), so any mesh
can load them; AdamW's step count, the training step
(which is also the data position: batches are a pure function of seed and step) in
paratrain.json; each rank's random state (`rng.rank<r>`), restored when the layout is the
same, since only then does rank r do the same work.

Collective operations go through DCP (gloo or NCCL on the world group), not paratrain.comm:
their bytes are not in the ledger, and they happen only at checkpoint steps.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from paratrain import comm
from paratrain.checkpoint.not_saved import saving
from paratrain.checkpoint.planner import (
    ShardedSavePlanner,
)
from paratrain.checkpoint.training_state import compress_meta, diloco_meta, engine_state
from paratrain.config import RunConfig
from paratrain.mesh import Mesh
from paratrain.parallel.tensor_parallel.rng import RngTracker

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
META_FILE = "paratrain.json"
COMMIT_FILE = ".metadata"  # DCP's, renamed into place after every shard is written
PREFIX = "step_"
# What a resumed run keeps, beside the model (the optimizer: its state is what is saved).
RESUMED = ("global_batch", "seq_len", "optimizer", "lora_rank", "lora_alpha", "lora_targets")


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"{PREFIX}{step:07d}"


def _all(run_dir: Path) -> list[tuple[Path, int]]:
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        if path.is_dir() and path.name.startswith(PREFIX) and path.name[len(PREFIX) :].isdigit():
            found.append((path, int(path.name[len(PREFIX) :])))
    return sorted(found, key=lambda x: x[1])


def is_complete(path: Path) -> bool:
    return (path / COMMIT_FILE).is_file() and (path / META_FILE).is_file()


def complete_checkpoints(run_dir: Path) -> list[Checkpoint]:
    return [Checkpoint(p, s) for p, s in _all(run_dir) if is_complete(p)]


def latest_checkpoint(run_dir: Path) -> Checkpoint | None:
    done = complete_checkpoints(run_dir)
    return done[-1] if done else None


def layout_of(cfg: RunConfig, mesh: Mesh) -> dict[str, int]:
    return {
        "world_size": mesh.shape.world_size,
        "dp": mesh.size("dp"),
        "pp": mesh.size("pp"),
        "tp": mesh.size("tp"),
        **({"cp": mesh.size("cp")} if mesh.size("cp") > 1 else {}),  # as before when cp = 1
        "zero": cfg.parallel.zero,
    }


def run_meta(
    cfg: RunConfig,
    mesh: Mesh,
    step: int,
    adam_step: int,
    fingerprint: str,
    loss_scale: dict[str, float] | None = None,
) -> dict[str, Any]:
    """paratrain.json's fields (an asynchronous run's checkpoint adds its server's state).

    loss_scale: fp16's scaler state, the same on every rank (every rank skips the same
    steps); without it a resumed run would start again from --loss-scale."""
    t = cfg.train
    return {
        "step": step,
        "adam_step": adam_step,
        "loss_scale": loss_scale,
        "dp_mode": cfg.parallel.dp_mode,
        **diloco_meta(cfg),
        **compress_meta(cfg),
        "layout": layout_of(cfg, mesh),
        "chunks": cfg.parallel.chunks,
        "model": asdict(cfg.model),
        "train": {
            "global_batch": t.global_batch,
            "seq_len": t.seq_len,
            "seed": t.seed,
            "optimizer": t.optimizer,
            **(
                {
                    "lora_rank": t.lora_rank,
                    "lora_alpha": t.lora_alpha,
                    "lora_targets": t.lora_targets,
                }
                if t.lora_rank
                else {}
            ),  # fmt: skip
        },
        "data_fingerprint_sha256": fingerprint,
        "saved": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def read_meta(path: Path) -> dict[str, Any]:
    """paratrain.json of a checkpoint, or ValueError saying what is wrong with it."""
    try:
        meta = json.loads((path / META_FILE).read_text())
        int(meta["step"])
        return meta
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"checkpoint {path} is unreadable ({META_FILE}: {e})") from None


def _rng_state(tracker: RngTracker | None, device: torch.device) -> dict[str, Any]:
    """The random streams dropout draws from: the CPU's, the rank's GPU's (dropout on CUDA
    tensors draws there), and tensor parallelism's named streams."""
    state = {"torch": torch.get_rng_state(), "tp": tracker.state_dict() if tracker else None}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], tracker: RngTracker | None, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state.get("cuda") is not None:
        torch.cuda.set_rng_state(state["cuda"], device)
    if tracker is not None and state.get("tp"):
        tracker.load_state_dict(state["tp"])


def scaler_state(engine: Any) -> dict[str, float] | None:
    scalers = [r.scaler for r in engine.replicas if r.scaler is not None]
    return scalers[0].state_dict() if scalers else None


def save(
    run_dir: Path,
    step: int,
    engine: Any,
    optimizer: Any,
    mesh: Mesh,
    cfg: RunConfig,
    fingerprint: str,
    keep: int = 0,
    storage_writer: Any = None,
    announce: bool = True,
) -> Path:
    """Write this step's checkpoint (collective over every rank); return its directory.
    announce: rank 0 logs it (False: a debug line; a stop's own line names it).

    Checkpointing coordinates over the control group (host-side gloo, which DCP's object
    collectives need); each tensor is written from wherever it lives.
    """
    world = mesh.control
    path = checkpoint_path(run_dir, step)
    state = engine_state(engine, optimizer, mesh)
    with saving(path, step, remover=mesh.global_rank == 0):
        if mesh.global_rank == 0:
            scale = scaler_state(engine)
            start_dir(path, run_meta(cfg, mesh, step, state.adam_step(), fingerprint, scale))
        comm.barrier(world)
        entries: dict[str, Any] = dict(state.tensors)
        entries[f"rng.rank{mesh.global_rank}"] = _rng_state(engine.rng_tracker, mesh.device)
        start = time.perf_counter()
        write_entries(path, entries, world.pg, storage_writer)
    if mesh.global_rank == 0:
        level = logging.INFO if announce else logging.DEBUG
        log.log(level, "checkpoint step %d: %s (%.2f s)", step, path, time.perf_counter() - start)
        prune(run_dir, keep)
    return path


def start_dir(path: Path, meta: dict[str, Any]) -> None:
    """A fresh directory for a save, holding paratrain.json (written first; the shards and
    DCP's .metadata, the commit point, follow)."""
    if path.exists():  # a save of this step that never finished
        shutil.rmtree(path)
    path.mkdir(parents=True)
    (path / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")


def write_entries(
    path: Path,
    entries: dict[str, Any],
    group: dist.ProcessGroup | None,
    storage_writer: Any = None,
) -> None:
    """DCP's save of `entries` into `path`: collective over `group`, or by this process
    alone when None (the parameter server, which holds all of the state)."""
    with warnings.catch_warnings():
        if group is None:  # "saving in one process": as meant
            warnings.simplefilter("ignore", UserWarning)
        dcp.save(
            entries,
            storage_writer=storage_writer or FileSystemWriter(path, thread_count=1),
            planner=ShardedSavePlanner(),
            process_group=group,
            no_dist=group is None,
        )


def prune(run_dir: Path, keep: int) -> None:
    """Keep the newest `keep` complete checkpoints (all if keep <= 0); drop incomplete ones
    older than the newest complete one (never one that may still be being written)."""
    done = complete_checkpoints(run_dir)
    if not done:
        return
    kept = {c.step for c in (done[-keep:] if keep > 0 else done)}
    for path, step in _all(run_dir):
        if (step not in kept) if is_complete(path) else (step < done[-1].step):
            shutil.rmtree(path, ignore_errors=True)
