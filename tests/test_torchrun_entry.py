"""`paratrain train` under a user's own torchrun (issue 30): no launcher of ours checks the
predicted memory or reports a stop, so each worker does. A layout beyond this machine's
memory is refused before any rank trains, in one line per node (local rank 0's; the
others exit 2 quietly); a stopped rank 0 prints the stop's line and exits 128 + the signal.

The refusal runs before any rendezvous, so the workers are started with torchrun's
environment and no torchrun (which costs seconds more to start than the check itself).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from paratrain.commands import train as train_command
from paratrain.config import RunConfig

HUGE = ["--seq-len", "100000", "--max-seq-len", "100000"]  # 12.83 TB of activations per rank


def test_a_users_torchrun_refuses_a_layout_beyond_memory_once_before_training(tmp_path):
    out = tmp_path / "run"
    workers = []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank)}
        env |= {"LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "localhost", "MASTER_PORT": "1"}
        argv = [sys.executable, "-m", "paratrain", "train", *HUGE, "--out", str(out)]
        workers.append(
            subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env)
        )
    try:
        said = [w.communicate(timeout=600)[1] for w in workers]
    finally:  # a worker that went on to train (the check missing) must not outlive the test
        for w in workers:
            w.kill()
    assert [w.returncode for w in workers] == [2, 2], said
    assert said[1] == "", said[1]  # local rank 0 speaks for its node
    line = said[0].strip()
    assert len(said[0].strip().splitlines()) == 1 and "Traceback" not in said[0], said[0]
    assert line.startswith("paratrain train: error: 2 ranks need 25.66 TB together"), line
    assert "beyond this host's available memory" in line
    assert not out.exists()  # no rank began: the run directory was never made


@pytest.mark.parametrize(("signal_name", "status"), [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_users_torchrun_rank_0_exits_with_the_stop_signals_status(
    tmp_path, monkeypatch, capsys, signal_name, status
):
    """What rank 0's worker returns after a graceful stop (run_then_exit exits with it)."""
    from paratrain.train import worker

    summary = {"stopped_at_step": 3, "stopped_by": signal_name, "run_dir": str(tmp_path)}
    monkeypatch.setattr(worker, "run_worker", lambda cfg, env, run_dir_prepared: summary)
    env = {"rank": 0, "world_size": 2, "local_rank": 0, "local_world_size": 2}
    assert train_command._work(RunConfig(), env, launched_worker=False, as_json=False) == status
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("paratrain train: stopped by "), err
    assert f"{signal_name}; no checkpoint was saved" in err[0].replace(")", ""), err
    # Our launcher's workers exit 0 after a stop: the launcher reports it, with the status.
    assert train_command._work(RunConfig(), env, launched_worker=True, as_json=False) == 0


def test_a_users_torchrun_stop_names_its_checkpoint_and_a_resume_through_torchrun(
    tmp_path, monkeypatch, capsys
):
    """Our launcher cannot continue a torchrun job: the line says to start torchrun again."""
    from paratrain import checkpoint as ck
    from paratrain.train import worker

    saved = ck.checkpoint_path(tmp_path, 3)
    saved.mkdir(parents=True)
    (saved / ck.COMMIT_FILE).write_bytes(b"")  # complete, as far as the line is concerned
    (saved / ck.META_FILE).write_text("{}")
    summary = {"stopped_at_step": 3, "stopped_by": "SIGTERM", "run_dir": str(tmp_path)}
    monkeypatch.setattr(worker, "run_worker", lambda cfg, env, run_dir_prepared: summary)
    env = {"rank": 0, "world_size": 2, "local_rank": 0, "local_world_size": 2}
    assert train_command._work(RunConfig(), env, launched_worker=False, as_json=False) == 143
    assert capsys.readouterr().err.strip() == (
        f"paratrain train: stopped by SIGTERM; checkpoint of step 3 in {saved}; "
        f"continue with torchrun again and `-m paratrain train --resume {tmp_path}`"
    )


def test_a_users_torchrun_resumes_in_the_run_directory_it_is_given(tmp_path):
    """The command the stop's line suggests: rank 0 writes into --resume's directory (it
    refused it as "already exists and is not empty" before) and keeps its config."""
    from paratrain.train.run_dir import worker_run_dir

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text("# the first start's\n")
    assert worker_run_dir(str(run), str(run)) == run
    assert (run / "config.1.toml").read_text() == "# the first start's\n"
    assert worker_run_dir(str(tmp_path / "new"), "") == tmp_path / "new"  # a fresh --out
