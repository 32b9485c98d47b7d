"""Sharded checkpoints: the boxes a rank holds, exact resume on the same mesh, resume on
other meshes within float32 tolerance, a crash during a save, retention, export, and the
non-finite-gradient skip."""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter

from paratrain import checkpoint as ck
from paratrain.checkpoint.state import flat_range_boxes
from tests.distributed import run_distributed
from tests.equivalence import tiny_config, tiny_data

STEPS, SAVED_AT = 6, 3
TOLERANCE = 1e-5  # float32 loss differences from another reduction order


def test_a_flat_range_is_a_few_contiguous_boxes_covering_it_exactly():
    for shape in [(7,), (3, 5), (2, 3, 4), (4, 1, 3)]:
        n = math.prod(shape)
        values = torch.arange(n).view(shape)
        for lo in range(n + 1):
            for hi in range(lo, n + 1):
                seen = []
                boxes = flat_range_boxes(shape, lo, hi)
                assert len(boxes) <= max(0, 2 * len(shape) - 1)
                for offsets, sizes, start in boxes:
                    box = values[
                        tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))
                    ]
                    assert box.reshape(-1).tolist() == list(range(start, start + box.numel()))
                    seen += box.reshape(-1).tolist()
                assert seen == list(range(lo, hi)), (shape, lo, hi)


def layout_run(rank, world_size, layout, zero, run_dir, resume_step, train=None):
    from paratrain.mesh import Mesh
    from paratrain.train.loop import train as train_loop

    dp, pp, tp = layout
    cfg = tiny_config(steps=STEPS, checkpoint_every=SAVED_AT, **(train or {}))
    cfg.parallel.dp, cfg.parallel.pp, cfg.parallel.tp, cfg.parallel.zero = dp, pp, tp, zero
    cfg.train.microbatches = cfg.train.global_batch // (cfg.train.micro_batch * dp)
    mesh = Mesh.build(dp=dp, pp=pp, tp=tp)
    resume = None
    if resume_step:
        resume = ck.Checkpoint(ck.checkpoint_path(Path(run_dir), resume_step), resume_step)
    result = train_loop(cfg, mesh, tiny_data(), run_dir=Path(run_dir), resume=resume)
    return [m.loss for m in result.metrics]


def _resume(tmp_path: Path, saved: Path, layout, zero, **train) -> list[float]:
    run = tmp_path / f"resume-{'x'.join(map(str, layout))}-z{zero}"
    shutil.copytree(saved, run)
    world = layout[0] * layout[1] * layout[2]
    return run_distributed(layout_run, world, layout, zero, str(run), SAVED_AT, train)[0]


def test_resume_is_exact_on_the_same_mesh_and_close_on_other_meshes(tmp_path):
    saved = tmp_path / "saved"  # dp 2 x tp 2 with ZeRO-2: flat shards that cut rows
    full = run_distributed(layout_run, 4, (2, 1, 2), 2, str(saved), 0)[0]
    assert [c.step for c in ck.complete_checkpoints(saved)] == [SAVED_AT, STEPS]
    tail = full[SAVED_AT:]
    assert _resume(tmp_path, saved, (2, 1, 2), 2) == tail  # bitwise
    for layout, zero in [((4, 1, 1), 1), ((2, 2, 1), 0), ((1, 2, 2), 0)]:
        resumed = _resume(tmp_path, saved, layout, zero)
        assert max(abs(a - b) for a, b in zip(resumed, tail, strict=True)) < TOLERANCE, layout
    # Another world size (4 -> 2): with no re-warmup the run continues as before ...
    resumed = _resume(tmp_path, saved, (1, 1, 2), 3, rewarmup_steps=0)
    assert max(abs(a - b) for a, b in zip(resumed, tail, strict=True)) < TOLERANCE
    # ... and with the default re-warmup the first resumed step uses 1/rewarmup of the rate.
    rewarmed = _resume(tmp_path, saved, (2, 1, 1), 0, rewarmup_steps=4)
    assert abs(rewarmed[0] - tail[0]) < TOLERANCE and abs(rewarmed[1] - tail[1]) > 1e-3


class DiesBeforeCommit(FileSystemWriter):
    """Writes every shard file, then the process dies before `.metadata` is renamed in."""

    def finish(self, metadata, results):
        os._exit(9)


def save_then_crash(rank, world_size, run_dir):
    from paratrain.mesh import Mesh
    from paratrain.train.loop import train as train_loop

    cfg = tiny_config(steps=2, checkpoint_every=0)
    cfg.parallel.dp, cfg.parallel.zero = 2, 1
    mesh = Mesh.build(dp=2)
    result = train_loop(cfg, mesh, tiny_data(), run_dir=Path(run_dir))  # saves step 2
    path = ck.checkpoint_path(Path(run_dir), 3)
    writer = DiesBeforeCommit(path, thread_count=1)
    ck.save(
        Path(run_dir), 3, result.engine, result.optimizer, mesh, cfg, "-", storage_writer=writer
    )


def test_a_crash_during_a_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    from paratrain.spawn import RankFailed

    with pytest.raises(RankFailed):
        run_distributed(save_then_crash, 2, str(tmp_path))
    broken = ck.checkpoint_path(tmp_path, 3)
    assert list(broken.glob("*.distcp")), "the shards should have been written"
    assert not (broken / ck.COMMIT_FILE).exists()
    assert ck.latest_checkpoint(tmp_path).step == 2
    ck.check_files(ck.latest_checkpoint(tmp_path).path)
    cfg = tiny_config(steps=2)
    cfg.parallel.dp, cfg.parallel.zero = 2, 1
    assert ck.find_resumable(tmp_path, cfg).step == 2


def test_only_the_newest_complete_checkpoints_are_kept(tmp_path):
    for step in (2, 4, 6, 8):
        path = ck.checkpoint_path(tmp_path, step)
        path.mkdir(parents=True)
        (path / ck.META_FILE).write_text("{}")
        if step != 4:  # 4 never committed
            (path / ck.COMMIT_FILE).write_bytes(b"")
    unfinished = ck.checkpoint_path(tmp_path, 10)  # may still be being written
    unfinished.mkdir()
    ck.prune(tmp_path, keep=2)
    assert sorted(p.name for p in (tmp_path / ck.CHECKPOINTS).iterdir()) == [
        "step_0000006",
        "step_0000008",
        "step_0000010",
    ]


def train_and_return_full_state(rank, world_size, run_dir):
    from paratrain.mesh import Mesh
    from paratrain.train.loop import train as train_loop

    cfg = tiny_config(steps=3)
    cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.zero = 1, 2, 2
    mesh = Mesh.build(dp=1, tp=2)
    result = train_loop(cfg, mesh, tiny_data(), run_dir=Path(run_dir))
    from paratrain.parallel.tensor_parallel.state import full_state_dict

    return full_state_dict(result.model, mesh.group("tp"))


def test_export_gives_a_single_process_model_with_the_trained_weights(tmp_path):
    from paratrain.trained.safetensors_file import export_safetensors, load_exported

    expected = run_distributed(train_and_return_full_state, 2, str(tmp_path))[0]
    model = load_exported(export_safetensors(tmp_path))
    state = model.state_dict()
    assert state.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=0, msg=name)


def nan_at(rank, world_size, bad_steps, max_skipped):
    """Rank 1's logits become NaN in `bad_steps`, as an overflow would make them: its
    gradients are NaN before the all-reduce, so every replica's are after it."""
    from paratrain.mesh import Mesh
    from paratrain.train.loop import train

    done = {"steps": 0}

    def poison(_module, _args, out):
        return out * float("nan") if done["steps"] + 1 in bad_steps else out

    def on_start(engine):
        if rank == 1:
            engine.modules[0].head.register_forward_hook(poison)

    def on_step(m):
        done["steps"] = m.step

    cfg = tiny_config(steps=5, max_skipped_steps=max_skipped)
    cfg.parallel.dp = 2
    try:
        result = train(cfg, Mesh.build(dp=2), tiny_data(), on_step=on_step, on_start=on_start)
    except RuntimeError as e:
        return str(e)
    return [m.skipped for m in result.metrics], result.optimizer.optimizers[0].state_dict()


def test_a_non_finite_gradient_skips_the_step_on_every_rank():
    results = run_distributed(nan_at, 2, {2}, 3)
    (skipped0, opt0), (skipped1, _) = results
    assert skipped0 == skipped1 == [False, True, False, False, False]
    # AdamW ran 4 times, not 5: the skipped step changed nothing.
    assert all(int(s["step"]) == 4 for s in opt0["state"].values())


def test_too_many_non_finite_steps_in_a_row_stop_the_run():
    for message in run_distributed(nan_at, 2, {2, 3}, 2):
        assert "2 consecutive steps (up to step 3) had a non-finite gradient norm" in message


# Long enough that no ordinary collective of steps 1-3 (a checkpoint save included) times
# out on a machine whose CPUs other processes keep busy; short enough for the suite.
HANG_TIMEOUT_S = 4.0


class GaveUp(Exception):
    pass


def hang_in_step_3(rank, world_size, run_dir):
    """Rank 1 stops (a long sleep) after step 2's checkpoint; rank 0 must time out in step 3
    with a report, not wait forever."""
    import time

    from paratrain.comm.group import CommOptions
    from paratrain.mesh import Mesh
    from paratrain.train.loop import train

    hang_began = []

    def after_step(m):
        if m.step == 3:
            hang_began.append(time.monotonic())  # rank 0 goes on into step 4's collectives
        if rank == 1 and m.step == 3:
            time.sleep(HANG_TIMEOUT_S + 4)
            raise GaveUp

    cfg = tiny_config(steps=5, checkpoint_every=2)
    cfg.parallel.dp = 2
    mesh = Mesh.build(dp=2, options=CommOptions(timeout_s=HANG_TIMEOUT_S))
    try:
        train(cfg, mesh, tiny_data(), on_step=after_step, run_dir=Path(run_dir))
    except GaveUp:
        return "gave up", time.monotonic() - hang_began[0]
    except Exception as e:  # CommError on rank 0
        return str(e), time.monotonic() - hang_began[0]
    return None, None


def test_a_hung_rank_is_reported_in_time_and_the_last_checkpoint_stays_intact(tmp_path):
    (message, elapsed), _ = run_distributed(hang_in_step_3, 2, str(tmp_path))
    assert message is not None
    assert "rank 0 (rank 0 of group 'dp'" in message and "in training step 4" in message, message
    assert "rank 1 did not make this call" in message
    # From the end of step 3: the timeout, the report's half second for peers to publish
    # and its store reads, and room for a machine whose CPUs other processes keep busy.
    assert elapsed < HANG_TIMEOUT_S + 12, elapsed
    assert ck.latest_checkpoint(tmp_path).step == 2
    ck.check_files(ck.latest_checkpoint(tmp_path).path)
