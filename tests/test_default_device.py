"""Every tensor that paratrain allocates follows the device of the tensors it serves.

This machine has no GPU, so the proof runs on the CPU with the default device set to
`meta`: the model and the data live on the CPU, and any factory call that names no device
(`torch.zeros(n)`) makes a meta tensor, which fails loudly the moment it meets a real one
or a collective. Plain PyTorch passes this check (AdamW, clip_grad_norm_), so must we.

Each rank runs what a `paratrain train` worker runs (`_train_and_record`: run directory,
training, checkpoint save, resume from it, final evaluation, the planner's comparison) twice
in the same process, once with the default device left alone and once with it set to meta;
the losses, gradient norms and validation losses must be identical.
"""

from __future__ import annotations

import json
from pathlib import Path
from textwrap import __file__ as TEXTWRAP

import pytest
import torch

from tests.distributed import run_distributed

LAYOUTS = {  # name: (world size, parallel options)
    "dp": (2, {"dp": 2}),
    "dp-ring": (2, {"dp": 2, "comm_algo": "ring"}),
    "zero1": (2, {"dp": 2, "zero": 1}),
    "zero2": (2, {"dp": 2, "zero": 2}),
    "zero3": (2, {"dp": 2, "zero": 3}),
    "tp-sp": (2, {"tp": 2, "sequence_parallel": True}),
    "pp-1f1b": (2, {"pp": 2, "schedule": "1f1b"}),
    "pp-interleaved": (2, {"pp": 2, "schedule": "interleaved", "chunks": 2}),
    "3d": (8, {"dp": 2, "pp": 2, "tp": 2}),
    "async": (2, {"dp_mode": "async"}),
}
FIRST_STEPS, ALL_STEPS = 3, 4  # the second run resumes from the first run's last checkpoint


def _config(options: dict, world: int, out: Path, steps: int, resume: bool):
    from paratrain.config import RunConfig
    from paratrain.validate import resolve_and_check

    cfg = RunConfig()
    m, t, p = cfg.model, cfg.train, cfg.parallel
    m.n_layer, m.n_head, m.d_model, m.max_seq_len = 4, 2, 32, 32
    t.seq_len, t.global_batch, t.micro_batch, t.steps = 16, 8, 2, steps
    t.lr, t.warmup_steps, t.val_batches, t.checkpoint_every = 1e-2, 2, 2, 2
    t.trace = options.get("pp", 1) > 1  # the pipeline's timeline is gathered too
    t.out, t.resume = str(out), str(out) if resume else ""
    p.nproc = world
    for key, value in options.items():
        setattr(p, key, value)
    cfg.data.path = TEXTWRAP
    return resolve_and_check(cfg, world)


def _history(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "losses": [r["loss"] for r in rows],
        "grad_norms": [r["grad_norm"] for r in rows],
        "val_loss": summary["val_loss"],
    }


def train_with_each_default(rank, world, options, base):
    from paratrain.comm import CommOptions
    from paratrain.mesh import Mesh
    from paratrain.train.preemption import Preemption
    from paratrain.train.worker import _train_and_record

    degrees = {axis: options.get(axis, 1) for axis in ("pp", "tp")}
    degrees["dp"] = world // (degrees["pp"] * degrees["tp"])
    algo = options.get("comm_algo", "native")
    mesh = Mesh.build(**degrees, options=CommOptions(timeout_s=60, algo=algo), device="cpu")
    histories = {}
    for default in ("cpu", "meta"):
        out = Path(base) / default
        torch.set_default_device(default)
        try:
            stop = Preemption(mesh.control)
            cfg = _config(options, world, out, FIRST_STEPS, resume=False)
            _train_and_record(cfg, mesh, run_dir_prepared=True, stop=stop)
            cfg = _config(options, world, out, ALL_STEPS, resume=True)  # async: the server's
            _train_and_record(cfg, mesh, run_dir_prepared=True, stop=stop)
            stop.close()
        finally:
            torch.set_default_device(None)
        if rank == 0:
            histories[default] = _history(out)
    mesh.close()
    return histories


@pytest.mark.parametrize("name", LAYOUTS)
def test_training_allocates_nothing_on_the_default_device(tmp_path, name):
    world, options = LAYOUTS[name]
    for default in ("cpu", "meta"):
        (tmp_path / default).mkdir()
    histories = run_distributed(train_with_each_default, world, options, str(tmp_path))[0]
    plain, meta = histories["cpu"], histories["meta"]
    assert len(plain["losses"]) == ALL_STEPS  # the resumed run added its step
    assert meta == plain  # bitwise: the same computation, only the default device differs
    assert plain["val_loss"] == plain["val_loss"]  # evaluated (not NaN)
