"""A worker's error is printed once, by the first rank to fail; the launcher names that rank
without announcing output nobody printed; a failed start leaves nothing behind (issue 21)."""

from __future__ import annotations

import contextlib
import io
import json
import signal

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from paratrain.checkpoint import COMMIT_FILE, META_FILE, checkpoint_path
from paratrain.launch import failure_line, root_failure
from paratrain.train.failed_start import before_start, undo_failed_start
from paratrain.train.failure import INTERNAL_ERROR, USER_ERROR, describe_failure, report_failure
from tests.distributed import run_distributed


def _fail_together(rank: int, world: int) -> tuple[int, str]:
    dist.barrier()  # every rank fails at the same moment: the race the store decides
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            raise ValueError("the same bad input on every rank")
        except ValueError as e:
            status = report_failure(e, rank)
    return status, stderr.getvalue()


def test_when_every_rank_fails_at_once_exactly_one_prints():
    results = run_distributed(_fail_together, 4)
    assert [status for status, _ in results] == [USER_ERROR] * 4
    printed = [text for _, text in results if text]
    assert len(printed) == 1, printed
    assert printed[0].count("\n") == 1 and "the same bad input on every rank" in printed[0]


def test_user_errors_are_one_line_and_internal_errors_carry_the_traceback():
    status, text = describe_failure(ValueError("--lr must be positive"), rank=3)
    assert status == USER_ERROR and text == "paratrain train: error (rank 3): --lr must be positive"
    status, text = describe_failure(
        torch.OutOfMemoryError("CUDA out of memory. Tried 2 GiB"), rank=1
    )
    assert status == USER_ERROR and "\n" not in text and "out of memory" in text
    try:
        {}["missing"]
    except KeyError as e:
        status, text = describe_failure(e, rank=0)
    assert status == INTERNAL_ERROR and "Traceback" in text and "KeyError" in text


def _failure(tmp_path, local_rank: int, exitcode: int, spoke: bool) -> ProcessFailure:
    error_file = tmp_path / f"error_{local_rank}.json"
    if spoke:
        message = {"message": "ValueError: bad", "extraInfo": {"timestamp": "1"}}
        error_file.write_text(json.dumps({"message": message}))
    return ProcessFailure(local_rank, 100 + local_rank, exitcode, str(error_file))


def test_the_launcher_names_the_rank_that_printed(tmp_path):
    failures = {0: _failure(tmp_path, 0, 1, False), 1: _failure(tmp_path, 1, 2, True)}
    rank, failure = root_failure(failures)
    assert rank == 1
    assert failure_line(rank, failure).endswith("(its error is printed above)")


def test_a_launch_leaves_no_directory_of_the_agent_behind(tmp_path, monkeypatch):
    """torch's agent keeps its per-rank error files in a directory of its own, by default
    a torchelastic_* in the temporary directory, never removed; ours goes with the launch."""
    import tempfile

    from paratrain.launch import launch_workers

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    launch_workers(1, ["--version"])
    assert list(tmp_path.iterdir()) == []


def test_the_launcher_never_claims_output_that_was_not_printed(tmp_path):
    killed = _failure(tmp_path, 1, -signal.SIGKILL, False)
    failures = {0: _failure(tmp_path, 0, 1, True), 1: killed}
    rank, failure = root_failure(failures)  # killed from outside: the root cause
    assert rank == 1
    assert "killed by SIGKILL, maybe for lack of memory; it printed nothing" in failure_line(
        rank, failure
    )
    silent = _failure(tmp_path, 2, 1, False)
    assert failure_line(2, silent).endswith("(it reported no error)")


def _checkpoint(run_dir, step: int) -> None:
    path = checkpoint_path(run_dir, step)
    path.mkdir(parents=True)
    (path / COMMIT_FILE).write_bytes(b"index")
    (path / META_FILE).write_text("{}")


def test_a_failed_resume_puts_the_run_directory_back_unless_it_saved(tmp_path):
    run = tmp_path / "run"
    (run / "tensorboard").mkdir(parents=True)
    (run / "config.toml").write_text("steps = 10\n")
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    _checkpoint(run, 1)
    before = before_start(run, fresh=False)
    (run / "config.toml").rename(run / "config.1.toml")  # what a resume does first
    (run / "config.toml").write_text("steps = 20\n")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "tensorboard" / "events.1").write_bytes(b"new")
    assert "is as it was" in undo_failed_start(before)
    assert sorted(p.name for p in run.rglob("*") if p.is_file()) == [
        COMMIT_FILE, "config.toml", "metrics.jsonl", META_FILE
    ]  # fmt: skip
    assert (run / "config.toml").read_text() == "steps = 10\n"
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
    (run / "metrics.jsonl").write_text("3 more steps\n")
    _checkpoint(run, 4)  # progress: a resume must find it, and the metrics with it
    assert "resume it from step 4" in undo_failed_start(before)
    assert (run / "metrics.jsonl").read_text() == "3 more steps\n"


def test_a_failed_fresh_start_leaves_no_directory_unless_it_saved(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    before = before_start(run, fresh=True)
    (run / "config.toml").write_text("steps = 10\n")
    assert "was removed" in undo_failed_start(before) and not run.exists()
    run.mkdir()
    _checkpoint(run, 2)
    assert "resume it from step 2" in undo_failed_start(before) and run.exists()
