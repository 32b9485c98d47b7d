"""Sharded checkpoints with torch.distributed.checkpoint, one package: a run directory's
checkpoints and their commit point (store.py: save, find, prune; compatible.py: whether one
can continue this run), reading one into a
rank's part of the model (load.py, with planner.py's DCP load planner), what each rank
saves (state.py) and the persistent buffers (buffers.py), a checkpoint's model whole in
one process for export, --init-from and imports (whole_model.py), and the parameter
server's checkpoints of asynchronous runs (server.py). Continuing a run from one is the
training loop's (train/resume.py).

`from paratrain import checkpoint` gives store.py's names, the ones every caller uses.
Imports `comm`, `config`, `mesh`, `models` and `parallel`; never `train/`.
"""

from paratrain.checkpoint.compatible import check_compatible, check_files, find_resumable
from paratrain.checkpoint.store import (
    CHECKPOINTS,
    COMMIT_FILE,
    META_FILE,
    Checkpoint,
    checkpoint_path,
    complete_checkpoints,
    is_complete,
    latest_checkpoint,
    layout_of,
    prune,
    read_meta,
    run_meta,
    save,
    scaler_state,
    set_rng_state,
    start_dir,
    write_entries,
)

__all__ = [
    "CHECKPOINTS",
    "COMMIT_FILE",
    "META_FILE",
    "Checkpoint",
    "check_compatible",
    "check_files",
    "checkpoint_path",
    "complete_checkpoints",
    "find_resumable",
    "is_complete",
    "latest_checkpoint",
    "layout_of",
    "prune",
    "read_meta",
    "run_meta",
    "save",
    "scaler_state",
    "set_rng_state",
    "start_dir",
    "write_entries",
]
