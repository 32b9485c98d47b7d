"""Checkpoints, resume and stopping of asynchronous (parameter-server) runs, the server's
failure when a worker is gone, and --recompute in them (end to end: the async tests in
tests/test_reliability_cli.py).

What is exact, and why. With one worker (dp 2: the server and one worker) nothing races:
the worker pushes, the server applies and answers, so the run is deterministic, and a
resumed run's losses and final parameters are compared with the uninterrupted run's
bitwise. With two workers the order of updates depends on timing; what stays exact is the
bookkeeping: the version and the batch positions continue from the checkpoint, no batch
is applied twice, and each worker's batch in flight at the save is applied after the
resume. What the server loads equals what it held when it saved, bitwise, in both cases.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from paratrain import checkpoint as ck
from paratrain.checkpoint.planner import CheckpointMismatch
from paratrain.config import RunConfig
from tests.distributed import run_distributed
from tests.equivalence import tiny_config, tiny_data

STEPS, SAVED_AT = 6, 3
MOMENTS = ("exp_avg", "exp_avg_sq", "step")


def async_config(world_size: int, **train) -> RunConfig:
    train = {"steps": STEPS, "checkpoint_every": SAVED_AT, "keep_checkpoints": 0} | train
    cfg = tiny_config(**train)
    cfg.parallel.dp_mode, cfg.parallel.dp = "async", world_size
    return cfg


def _loads_back_bitwise(result, run_dir: Path, mesh, cfg) -> bool:
    """The last checkpoint, loaded into a fresh model and optimizer, equals the live state
    the server ended with (the last save follows the last update)."""
    from paratrain.checkpoint.server import load_server
    from paratrain.parallel.data_parallel.adamw import adamw
    from paratrain.train.build import build_model

    t = cfg.train
    model = build_model(cfg, mesh.device)
    optimizer = adamw(model, t.lr, t.weight_decay, (t.beta1, t.beta2))
    load_server(ck.latest_checkpoint(run_dir), model, optimizer, mesh, cfg)
    pairs = list(zip(model.parameters(), result.model.parameters(), strict=True))
    live = result.optimizer.state
    return all(a.equal(b) for a, b in pairs) and all(
        optimizer.state[a][k].equal(live[b][k]) for a, b in pairs for k in MOMENTS
    )


def async_run(rank, world_size, run_dir, resume_step, train=None):
    from paratrain.mesh import Mesh
    from paratrain.train.async_loop import train_async

    cfg = async_config(world_size, **(train or {}))
    mesh = Mesh.build(dp=world_size)
    run_dir, resume = Path(run_dir), None
    if resume_step:
        resume = ck.Checkpoint(ck.checkpoint_path(run_dir, resume_step), resume_step)
    result = train_async(cfg, mesh, tiny_data(), run_dir=run_dir, resume=resume)
    if rank != 0:
        return None
    return {
        "losses": [m.loss for m in result.metrics],
        "steps": [m.step for m in result.metrics],
        "params": [p.detach().clone() for p in result.model.parameters()],
        "updates": [(u.index, u.batch) for u in result.extra["report"].updates],
        "loads_back": _loads_back_bitwise(result, run_dir, mesh, cfg),
    }


def saved_meta(run_dir: Path, step: int) -> dict:
    return json.loads((ck.checkpoint_path(run_dir, step) / ck.META_FILE).read_text())


def resume_copy(tmp_path: Path, saved: Path, name: str) -> Path:
    """The run directory as it was at the checkpoint of SAVED_AT."""
    run = tmp_path / name
    shutil.copytree(saved, run)
    shutil.rmtree(ck.checkpoint_path(run, STEPS))
    return run


def test_a_resumed_one_worker_run_equals_the_uninterrupted_one(tmp_path):
    saved = tmp_path / "saved"
    full = run_distributed(async_run, 2, str(saved), 0)[0]
    assert [c.step for c in ck.complete_checkpoints(saved)] == [SAVED_AT, STEPS]
    assert full["loads_back"]
    meta = saved_meta(saved, SAVED_AT)  # one worker: one update per step
    assert meta["dp_mode"] == "async" and meta["adam_step"] == SAVED_AT
    assert meta["async"] == {
        "version": 3, "next_batch": 4, "assigned": {"1": 3}, "dc_mean_square": False
    }  # fmt: skip
    run = resume_copy(tmp_path, saved, "resumed")
    resumed = run_distributed(async_run, 2, str(run), SAVED_AT)[0]
    assert resumed["steps"] == list(range(SAVED_AT + 1, STEPS + 1))
    assert resumed["updates"][0] == (SAVED_AT, SAVED_AT)  # update 3 applies batch 3
    assert resumed["losses"] == full["losses"][SAVED_AT:]  # bitwise
    assert all(a.equal(b) for a, b in zip(resumed["params"], full["params"], strict=True))
    assert resumed["loads_back"]
    assert saved_meta(run, STEPS)["async"] == saved_meta(saved, STEPS)["async"]


def test_two_workers_resume_at_the_saved_version_and_batches(tmp_path):
    saved, workers = tmp_path / "saved", 2
    full = run_distributed(async_run, 1 + workers, str(saved), 0)[0]
    assert full["loads_back"]
    position = saved_meta(saved, SAVED_AT)["async"]
    version = workers * SAVED_AT
    assigned = sorted(position["assigned"].values())
    assert position["version"] == version and position["next_batch"] == version + workers
    # Every batch handed out before the save was applied exactly once, or is in flight.
    before = sorted(b for i, b in full["updates"] if i < version)
    assert sorted(before + assigned) == list(range(version + workers))
    run = resume_copy(tmp_path, saved, "resumed")
    resumed = run_distributed(async_run, 1 + workers, str(run), SAVED_AT)[0]
    assert resumed["steps"] == list(range(SAVED_AT + 1, STEPS + 1))
    indices = [i for i, _ in resumed["updates"]]
    after = [b for _, b in resumed["updates"]]
    assert indices == list(range(version, workers * STEPS))  # the version continues
    # Every batch handed out, before the save or after the resume, was applied exactly
    # once or is in flight at the end (the checkpoint of the last step says which), and
    # the batches in flight at the save were handed out again, not skipped. With no
    # staleness bound nothing waits for a worker the machine starves: its batch may still
    # be in flight when the other has made the run's last updates (seen in CI under load).
    end = saved_meta(run, STEPS)["async"]
    in_flight = sorted(end["assigned"].values())
    assert sorted(before + after + in_flight) == list(range(end["next_batch"]))
    assert set(assigned) <= set(after) | set(in_flight)
    assert resumed["loads_back"]


def stopped_run(rank, world_size, run_dir):
    from paratrain.mesh import Mesh
    from paratrain.train.async_loop import train_async

    cfg = async_config(world_size)

    def signalled() -> bool:  # the workers are; the server's own flag stays down
        return rank != 0

    result = train_async(
        cfg, Mesh.build(dp=world_size), tiny_data(), None, Path(run_dir), None, signalled
    )
    if rank != 0:
        return None
    updates = [(u.index, u.batch) for u in result.extra["report"].updates]
    return result.extra.get("stopped_at"), [m.step for m in result.metrics], updates


def test_a_workers_stop_reaches_the_server_which_saves_at_the_step_boundary(tmp_path):
    """Both workers say so in their first push: the server stops after step 1 (2 updates),
    saves it, and answers every later push with STOP; every rank returns."""
    stopped_at, steps, updates = run_distributed(stopped_run, 3, str(tmp_path))[0]
    assert stopped_at == 1 and steps == [1] and [i for i, _ in updates] == [0, 1]
    assert [c.step for c in ck.complete_checkpoints(tmp_path)] == [1]
    position = saved_meta(tmp_path, 1)["async"]
    assert position["version"] == 2 and position["next_batch"] == 4
    applied = [b for _, b in updates]
    assert sorted(applied + list(position["assigned"].values())) == [0, 1, 2, 3]


def recompute_run(rank, world_size, recompute):
    from paratrain.mesh import Mesh
    from paratrain.train.async_loop import train_async

    cfg = async_config(world_size, recompute=recompute, steps=4)
    result = train_async(cfg, Mesh.build(dp=world_size), tiny_data())
    if rank == 0:
        return [m.loss for m in result.metrics]
    return all(getattr(b.forward, "recomputed", False) for b in result.model.blocks.values())


def test_recompute_full_in_async_gives_the_losses_of_a_run_without():
    """One worker, so both runs are deterministic. Recomputation runs each block's forward
    again in backward, the same kernels on the same inputs: on the CPU the gradients, so
    every later loss, are bitwise those of the run that kept its activations."""
    plain, plain_worker = run_distributed(recompute_run, 2, "none")
    again, again_worker = run_distributed(recompute_run, 2, "full")
    assert not plain_worker and again_worker  # the worker's blocks really recompute
    assert again == plain


def meta_of(cfg: RunConfig, dp_mode: str | None, dp: int) -> dict:
    meta = {"model": asdict(cfg.model), "train": {"global_batch": cfg.train.global_batch}}
    meta["layout"] = {"world_size": dp, "dp": dp, "pp": 1, "tp": 1, "zero": 0}
    return meta | ({"dp_mode": dp_mode} if dp_mode else {})  # none: saved before async


@pytest.mark.parametrize(
    ("saved", "now", "message"),
    [
        (("async", 3), ("sync", 3), "parallel.dp_mode = sync but the checkpoint has async"),
        ((None, 2), ("async", 2), "parallel.dp_mode = async but the checkpoint has sync"),
        (("async", 3), ("async", 2), "checkpoint has 2 worker.s.; resume on 3 processes"),
    ],
)
def test_a_run_resumes_only_in_the_mode_and_with_the_workers_that_saved_it(saved, now, message):
    cfg = tiny_config()
    cfg.parallel.dp_mode, cfg.parallel.dp = now
    with pytest.raises(CheckpointMismatch, match=message):
        ck.check_compatible(meta_of(cfg, *saved), cfg, Path("ckpt"))
    ck.check_compatible(meta_of(cfg, *saved), cfg, Path("ckpt"), train=())  # weights: any
    cfg.parallel.dp_mode, cfg.parallel.dp = saved[0] or "sync", saved[1]
    ck.check_compatible(meta_of(cfg, *saved), cfg, Path("ckpt"))


class LeftTheRun(Exception):
    pass


def a_worker_leaves(rank, world_size, timeout_s):
    """The server serves; the worker closes its connections instead of pushing its first
    gradient, as a killed process's close (the harness cannot kill a rank outright)."""
    import time

    import torch.distributed as dist

    from paratrain.comm.group import CommOptions
    from paratrain.mesh import Mesh
    from paratrain.parallel.data_parallel.async_sgd import serve, work
    from paratrain.train.build import build_model

    cfg = async_config(world_size)
    mesh = Mesh.build(dp=world_size, options=CommOptions(timeout_s=timeout_s))
    group, model = mesh.group("dp"), build_model(cfg)
    if group.rank != 0:

        def compute(batch: int) -> tuple[float, float]:
            dist.destroy_process_group()
            raise LeftTheRun

        with pytest.raises(LeftTheRun):
            work(model, group, mesh.control, compute)
        return None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    start = time.monotonic()
    with pytest.raises(Exception) as failure:
        serve(model, optimizer, group, mesh.control, 10, lambda update: None, lambda: 0.0)
    return time.monotonic() - start, str(failure.value)


def test_the_server_fails_at_once_when_a_worker_is_gone():
    """A dead worker must bring the server down now, not after the comm timeout (a
    receive from any rank would wait it out), so that --max-restarts restarts at once."""
    elapsed, message = run_distributed(a_worker_leaves, 2, 60.0)[0]
    assert elapsed < 20, (elapsed, message)
    assert "recv" in message and "peer rank 1" in message, message
