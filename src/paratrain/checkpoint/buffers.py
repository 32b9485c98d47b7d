"""Checkpoints written before they held buffers: what they lack, and the one line saying so.

Since buffers are saved (`buffer.<name>`, state.py), a checkpoint of a model with
persistent buffers holds them; one written before does not. Such a checkpoint still loads
(resume, restarts, --init-from, eval, export): the buffers it lacks keep the values the
model was built with, and one warning line names them. Accepted rather than refused
because the only persistent buffer of our models is the router's balancing bias, whose
initial value (0) is a valid state: the balancing starts again from it and steers the load
back within a few steps of the rate, so the run goes on, just not exactly as the one that
saved the checkpoint (docs/reliability.md, "Sharded checkpoints").
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from torch.distributed.checkpoint import FileSystemReader

from paratrain.checkpoint.state import BUFFER


def saved_keys(path: Path) -> set[str]:
    """Every key the complete checkpoint at `path` holds (DCP's index)."""
    return set(FileSystemReader(path).read_metadata().state_dict_metadata)


def absent_buffers(keys: Iterable[str], path: Path) -> list[str]:
    """The `buffer.` keys among `keys` that the checkpoint at `path` does not hold."""
    saved = saved_keys(path)
    return sorted(k for k in keys if k.startswith(BUFFER) and k not in saved)


def absent_note(path: Path, absent: list[str]) -> str:
    names = ", ".join(k.removeprefix(BUFFER) for k in absent)
    return (
        f"checkpoint {path} holds no value for {names} (written before checkpoints held "
        "buffers): they keep their initial values, so the router's balancing bias starts "
        "again from 0"
    )
