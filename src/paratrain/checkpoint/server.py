"""Checkpoints of asynchronous (parameter-server) runs: the server saves and loads alone.

Everything else is the synchronous checkpoint's (store.py): the run directory's
`checkpoints/step_<n>/`, paratrain.json written first and DCP's `.metadata` renamed into
place last (the commit point), the completeness check, retention (--keep-checkpoints), and
the model and AdamW's moments under the plain model's names, so that export, eval,
--init-from and a resume's checks read an asynchronous run's checkpoints like any other.

Only the server writes. It holds the whole model and the optimizer; the workers hold
nothing that outlives a batch (their parameters come from the server, their dropout is
seeded per batch), so a save never waits for a worker: DCP runs without a process group.
Saves happen at step boundaries (version = workers * step), so `step_<n>` means what it
means in a synchronous run: n steps of G sequences done. paratrain.json adds
`"dp_mode": "async"` and the server's state (parallel/data_parallel/async_sgd.py, `ServerState`):

    "async": {"version": 12, "next_batch": 14, "assigned": {"1": 12, "2": 13},
              "dc_mean_square": false}

`assigned` is each worker's data position: the batch it was computing, which a resumed
server hands it again. DC-ASGD-a's mean square, when it has one, is the tensor
`async.dc_mean_square`.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paratrain import checkpoint
from paratrain.checkpoint import Checkpoint
from paratrain.checkpoint.buffers import absent_buffers, absent_note
from paratrain.checkpoint.load import read_entries
from paratrain.checkpoint.not_saved import saving
from paratrain.checkpoint.state import RankState, rank_state
from paratrain.config import RunConfig
from paratrain.mesh import Mesh
from paratrain.parallel.data_parallel.async_sgd import ParameterServer
from paratrain.parallel.data_parallel.async_state import ServerState
from paratrain.parallel.data_parallel.whole_module import WholeGradients

log = logging.getLogger(__name__)

MEAN_SQUARE = "async.dc_mean_square"


def _server_state(model: nn.Module, optimizer: torch.optim.Optimizer, mesh: Mesh) -> RankState:
    """The model and AdamW's moments, whole (one box each): what a dp-1 replica holds."""
    return rank_state([WholeGradients(model)], [optimizer], mesh.group("dp").alone("tp"))


def save_server(
    run_dir: Path,
    step: int,
    server: ParameterServer,
    mesh: Mesh,
    cfg: RunConfig,
    fingerprint: str,
    keep: int = 0,
    announce: bool = True,
) -> Path:
    """Write the server's checkpoint of `step` (by the server alone); return its directory.
    announce: log it (False: a debug line; a stop's own line names it)."""
    path = checkpoint.checkpoint_path(run_dir, step)
    state, s = _server_state(server.model, server.optimizer, mesh), server.state
    meta = checkpoint.run_meta(cfg, mesh, step, state.adam_step(), fingerprint)
    meta["async"] = {
        "version": s.version,
        "next_batch": s.next_batch,
        "assigned": {str(w): b for w, b in sorted(s.assigned.items())},  # JSON keys
        "dc_mean_square": s.dc_mean_square is not None,
    }
    entries: dict[str, Any] = dict(state.tensors)
    if s.dc_mean_square is not None:
        entries[MEAN_SQUARE] = s.dc_mean_square
    start = time.perf_counter()
    with saving(path, step, remover=True):  # the server saves alone
        checkpoint.start_dir(path, meta)
        checkpoint.write_entries(path, entries, None)
    log.log(
        logging.INFO if announce else logging.DEBUG,
        "checkpoint step %d (update %d): %s (%.2f s)",
        step, s.version, path, time.perf_counter() - start,
    )  # fmt: skip
    checkpoint.prune(run_dir, keep)
    return path


def load_server(
    ckpt: Checkpoint,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    mesh: Mesh,
    cfg: RunConfig,
) -> ServerState:
    """Load `ckpt` into the server's model and optimizer (in place); return its state."""
    meta = checkpoint.read_meta(ckpt.path)
    checkpoint.check_compatible(meta, cfg, ckpt.path)  # the same mode and workers, too
    state = _server_state(model, optimizer, mesh)
    absent = absent_buffers(state.tensors, ckpt.path)  # saved before buffers were
    if absent:
        log.warning("%s", absent_note(ckpt.path, absent))
    entries: dict[str, Any] = {k: v for k, v in state.tensors.items() if k not in absent}
    saved = meta["async"]
    if saved["dc_mean_square"]:
        numel = sum(p.numel() for p in model.parameters())
        device = next(model.parameters()).device
        entries[MEAN_SQUARE] = torch.empty(numel, device=device)
    read_entries(entries, ckpt, None)
    state.set_adam_step(int(meta["adam_step"]))
    return ServerState(
        version=int(saved["version"]),
        next_batch=int(saved["next_batch"]),
        assigned={int(w): int(b) for w, b in saved["assigned"].items()},
        dc_mean_square=entries.get(MEAN_SQUARE),
    )
