"""Reading a sharded checkpoint into this rank's part of the model (collective).

`load` restores everything a resumed run needs: the model (parameters and persistent
buffers), AdamW's moments and step, and (on the layout that saved them) the random states.
`load_engine_weights` reads only the model into the engine, for evaluation on any layout
(checkpoint_model.load_weights copies whole tensors into a plain model instead). Each rank
reads only its own boxes (checkpoint/state.py). A checkpoint written before buffers
were saved loads with the buffers as built, and one warning line (buffers.py).
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from paratrain.checkpoint import (
    Checkpoint,
    check_compatible,
    layout_of,
    read_meta,
    set_rng_state,
)
from paratrain.checkpoint.buffers import absent_buffers, absent_note
from paratrain.checkpoint.planner import CheckpointMismatch, ShardedLoadPlanner
from paratrain.checkpoint.state import BUFFER, rank_state
from paratrain.checkpoint.training_state import COMPRESS, compress_meta, engine_state
from paratrain.config import RunConfig
from paratrain.mesh import Mesh

log = logging.getLogger(__name__)


def load(
    ckpt: Checkpoint, engine: Any, optimizer: Any, mesh: Mesh, cfg: RunConfig
) -> dict[str, Any]:
    """Load `ckpt` into this rank's model and optimizer; return its meta.

    Random states are restored only on the layout that saved them.
    """
    meta = read_meta(ckpt.path)
    check_compatible(meta, cfg, ckpt.path)
    state = engine_state(engine, optimizer, mesh)
    entries: dict[str, Any] = _present(dict(state.tensors), ckpt, mesh)
    same_layout = meta["layout"] == layout_of(cfg, mesh)
    same_layout = same_layout and meta.get("chunks") == cfg.parallel.chunks
    rng_key = f"rng.rank{mesh.global_rank}"
    if same_layout:
        entries[rng_key] = None  # replaced by the loaded object
    _keep_compression(entries, meta, cfg, same_layout, mesh.global_rank == 0)
    read_entries(entries, ckpt, mesh.control.pg)
    state.set_adam_step(int(meta["adam_step"]))
    for replica in engine.replicas:
        replica.after_load()
        if replica.scaler is not None and meta.get("loss_scale"):  # fp16 saved by fp16
            replica.scaler.load_state_dict(meta["loss_scale"])
    for replica in engine.replicas:  # --compress starts after --compress-start steps
        if getattr(replica, "compressor", None) is not None:
            replica.compressor.steps = int(meta["step"])
    if optimizer.outer is not None:  # saved at an outer step: global = local
        optimizer.outer.take_local()
    if same_layout:
        set_rng_state(entries[rng_key], engine.rng_tracker, mesh.device)
    return meta


def _keep_compression(
    entries: dict[str, Any], meta: dict[str, Any], cfg: RunConfig, same: bool, say: bool
) -> None:
    """Leave out the --compress state unless it was saved on this layout with these
    settings: each rank's errors are its own (training_state.py); `say`: log why."""
    saved, here = meta.get("compress"), compress_meta(cfg).get("compress")
    if same and saved == here:
        return
    for key in [k for k in entries if k.startswith(COMPRESS)]:
        del entries[key]
    if saved and say:
        why = (
            "another layout"
            if saved == here
            else f"--compress {here['method'] if here else 'none'}"
        )
        log.warning(
            "the checkpoint's --compress %s error buffers are not carried over (%s): "
            "they start again from zero",
            saved["method"],
            why,
        )


def load_engine_weights(
    ckpt: Checkpoint, engine: Any, optimizer: Any, mesh: Mesh, cfg: RunConfig
) -> None:
    """Load only the model's values (fp32 masters where they exist) of `ckpt`, on any
    layout, global batch or sequence length; the optimizer only names the pieces."""
    check_compatible(read_meta(ckpt.path), cfg, ckpt.path, train=())
    state = rank_state(engine.replicas, optimizer.optimizers, engine.tp)
    models = {k: v for k, v in state.tensors.items() if k.startswith(("model.", BUFFER))}
    read_entries(_present(models, ckpt, mesh), ckpt, mesh.control.pg)
    for replica in engine.replicas:
        replica.after_load()


def _present(entries: dict[str, Any], ckpt: Checkpoint, mesh: Mesh) -> dict[str, Any]:
    """`entries` without the buffers `ckpt` lacks (written before buffers were saved): those
    keep their values; rank 0 says so in one line."""
    absent = absent_buffers(entries, ckpt.path)
    if absent and mesh.global_rank == 0:
        log.warning("%s", absent_note(ckpt.path, absent))
    return {k: v for k, v in entries.items() if k not in absent}


def read_entries(
    entries: dict[str, Any], ckpt: Checkpoint, group: dist.ProcessGroup | None
) -> None:
    """Fill `entries` (`Sharded` boxes, tensors, objects) from `ckpt`; collective over
    `group`, or in this process alone when None (the parameter server reads by itself)."""
    try:
        with warnings.catch_warnings():
            if group is None:  # "loading in one process": as meant
                warnings.simplefilter("ignore", UserWarning)
            dcp.load(
                entries,
                storage_reader=FileSystemReader(ckpt.path),
                planner=ShardedLoadPlanner(),
                process_group=group,
                no_dist=group is None,
            )
    except CheckpointMismatch:
        raise
    except (Exception, CheckpointException) as e:  # DCP's derives from BaseException
        raise ValueError(
            f"checkpoint {ckpt.path} could not be loaded ({_first_failure(e)}); it is damaged: "
            "remove it to resume from an older one"
        ) from None


def _first_failure(e: BaseException) -> str:
    """One line for what went wrong: DCP gathers every rank's exception into one."""
    if isinstance(e, CheckpointException) and e.failures:
        rank, (cause, _) = min(e.failures.items())
        e = cause
        where = f"rank {rank}: "
    else:
        where = ""
    text = (str(e).strip() or "no message").splitlines()[0].split(". ")[0]  # first sentence
    return f"{where}{type(e).__name__}: {text}"
