"""A checkpoint's model, whole, in one process: read it (export, --init-from), or write one
(an import's step-0 checkpoint), without a process group.

The sharded checkpoint stores every parameter under the single-process model's name with
its global shape (`model.<name>`), and every persistent buffer (`buffer.<name>`: the
router's balancing bias), so consolidating is one DCP load into full-size tensors
allocated from the checkpoint's index; writing one is one DCP save of whole tensors, which
any mesh then loads like any other checkpoint's model.
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from paratrain import checkpoint
from paratrain.checkpoint.buffers import absent_buffers, absent_note
from paratrain.checkpoint.state import BUFFER, persistent_buffers
from paratrain.models import registry
from paratrain.parallel.data_parallel.whole_module import complete_state_dict

log = logging.getLogger(__name__)

PREFIX = "model."


def read_model(path: Path) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer of the complete checkpoint at `path`, whole,
    on the host (fp32: the master copies under mixed precision), under the plain model's
    names."""
    checkpoint.check_files(path)
    reader = FileSystemReader(path)
    index = reader.read_metadata().state_dict_metadata
    full = {
        key: torch.empty(md.size, dtype=md.properties.dtype, device="cpu")  # a file, read here
        for key, md in index.items()
        if key.startswith((PREFIX, BUFFER)) and isinstance(md, TensorStorageMetadata)
    }
    with warnings.catch_warnings():  # "no process group: loading in one process", as meant
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(full, storage_reader=reader, no_dist=True)
    return {key.removeprefix(PREFIX).removeprefix(BUFFER): t for key, t in full.items()}


def load_weights(model: nn.Module, tensors: dict[str, torch.Tensor], source: str) -> list[str]:
    """Copy `tensors` into the plain `model` (a tied parameter's other name aliases it);
    ValueError naming the first parameter missing, name unknown, or tensor of another
    shape. Persistent buffers absent from `tensors` (a checkpoint written before buffers
    were saved) keep the model's values: their names are returned."""
    known = model.state_dict(keep_vars=True)  # a tied parameter under each of its names
    for name, _ in model.named_parameters():
        if name not in tensors:
            raise ValueError(f"{source}: no weights for {name}")
    for name, t in tensors.items():
        ours = known.get(name)
        if ours is None:
            raise ValueError(f"{source}: {name} has no place in this model")
        if t.shape != ours.shape:
            shape, here = tuple(t.shape), tuple(ours.shape)
            raise ValueError(f"{source}: {name} has shape {shape}, this model {here}")
    with torch.no_grad():
        model.load_state_dict(complete_state_dict(model, tensors), strict=True)
    return sorted(set(persistent_buffers(model)) - set(tensors))


SHAPE = ("arch", "vocab_size", "n_layer", "n_head", "n_kv_head", "d_model", "ffn_hidden",
         "max_seq_len", "tie_embeddings")  # fmt: skip


def check_init_source(source: str, model: Any) -> None:
    """--init-from, before any worker starts: a complete checkpoint of a model of this
    shape (`model`: the run's [model]; names and sizes are checked again on loading)."""
    ckpt = checkpoint.latest_checkpoint(Path(source))
    if ckpt is None:
        raise ValueError(f"--init-from {source!r}: no complete checkpoint in its checkpoints/")
    checkpoint.check_files(ckpt.path)
    saved = checkpoint.read_meta(ckpt.path)["model"]
    for key in SHAPE:
        if key in saved and saved[key] != getattr(model, key):
            raise ValueError(
                f"--init-from {source!r}: its model.{key} is {saved[key]!r}, this run's "
                f"{getattr(model, key)!r}; leave the model's shape to the source run"
            )
    note_absent_buffers(ckpt.path, model)


def note_absent_buffers(path: Path, model: Any) -> None:
    """One warning line if the checkpoint at `path` lacks persistent buffers of the model
    that `model` (a [model] config) describes: --init-from's source, said once by the
    launcher (or rank 0 of a user's torchrun) before training; build_model keeps them."""
    with torch.device("meta"):  # names only: no memory, any size
        names = persistent_buffers(registry.plain_model(model))
    absent = absent_buffers([BUFFER + n for n in names], path)
    if absent:
        log.warning("%s", absent_note(path, absent))


def write_model(path: Path, model: nn.Module, meta: dict[str, Any]) -> None:
    """A complete checkpoint at `path` holding `model`'s parameters and persistent buffers
    (no optimizer state)."""
    path.mkdir(parents=True)
    (path / checkpoint.META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    state = {PREFIX + name: p.detach() for name, p in model.named_parameters()}
    state |= {BUFFER + name: b.detach() for name, b in persistent_buffers(model).items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=FileSystemWriter(path, thread_count=1), no_dist=True)
