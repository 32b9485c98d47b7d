"""A checkpoint's model, whole, in one process: read it (export, --init-from), or write one
(an import's step-0 checkpoint), without a process group.

The sharded checkpoint stores every parameter under the single-process model's name with
its global shape (`model.<name>`), so consolidating is one DCP load into full-size tensors
allocated from the checkpoint's index; writing one is one DCP save of whole tensors, which
any mesh then loads like any other checkpoint's model.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from paratrain.parallel.replica import complete_state_dict
from paratrain.train import checkpoint

PREFIX = "model."


def read_model(path: Path) -> dict[str, torch.Tensor]:
    """Every parameter of the complete checkpoint at `path`, whole, on the host (fp32: the
    master copies under mixed precision), under the plain model's names."""
    checkpoint.check_files(path)
    reader = FileSystemReader(path)
    index = reader.read_metadata().state_dict_metadata
    full = {
        key: torch.empty(md.size, dtype=md.properties.dtype, device="cpu")  # a file, read here
        for key, md in index.items()
        if key.startswith(PREFIX) and isinstance(md, TensorStorageMetadata)
    }
    with warnings.catch_warnings():  # "no process group: loading in one process", as meant
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(full, storage_reader=reader, no_dist=True)
    return {key.removeprefix(PREFIX): t for key, t in full.items()}


def load_weights(model: nn.Module, tensors: dict[str, torch.Tensor], source: str) -> None:
    """Copy `tensors` into the plain `model` (a tied parameter's other name aliases it);
    ValueError naming the first parameter missing or of another shape."""
    for name, p in model.named_parameters():
        if name not in tensors:
            raise ValueError(f"{source}: no weights for {name}")
        if tensors[name].shape != p.shape:
            shape = tuple(tensors[name].shape)
            raise ValueError(f"{source}: {name} has shape {shape}, this model {tuple(p.shape)}")
    with torch.no_grad():
        model.load_state_dict(complete_state_dict(model, tensors), strict=True)


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


def write_model(path: Path, model: nn.Module, meta: dict[str, Any]) -> None:
    """A complete checkpoint at `path` holding `model`'s parameters (no optimizer state)."""
    path.mkdir(parents=True)
    (path / checkpoint.META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    state = {PREFIX + name: p.detach() for name, p in model.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=FileSystemWriter(path, thread_count=1), no_dist=True)
