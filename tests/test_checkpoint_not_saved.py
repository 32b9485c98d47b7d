"""A checkpoint the filesystem refuses (issue 30: a full disk): one line naming the cause
and the path, its partial files removed, every earlier checkpoint and metrics.jsonl kept,
and the run directory kept once a step is logged. The disk is "full" through a storage
writer that writes part of a shard and then fails with ENOSPC, as DCP's writer does on a
full disk (checked by hand on a 300 KB and a 1 MB tmpfs with 2 workers: the same lines)."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from paratrain import checkpoint as ck
from paratrain.checkpoint.not_saved import os_error_in

TINY = [
    "--n-layer", "1", "--d-model", "32", "--n-head", "2", "--seq-len", "16",
    "--global-batch", "4", "--micro-batch", "2", "--val-batches", "1", "--nproc", "1",
    "--steps", "4", "--checkpoint-every", "2",
]  # fmt: skip


def full_disk_at(step: int) -> type[FileSystemWriter]:
    class FullDisk(FileSystemWriter):
        def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
            path = Path(str(self.path))
            if path.name == f"step_{step:07d}":
                (path / "__0_0.distcp").write_bytes(b"the first bytes of a shard")
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return super().write_data(plan, planner)

    return FullDisk


def train(tmp_path: Path, out: Path) -> tuple[int, str]:
    from paratrain.cli import main

    (tmp_path / "text.txt").write_text("\n".join(f"line {i} of some text" for i in range(3000)))
    err = io.StringIO()
    argv = ["train", *TINY, "--data", str(tmp_path / "text.txt"), "--out", str(out)]
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(argv)
    finally:
        if dist.is_initialized():  # the in-process worker failed inside its group
            dist.destroy_process_group()
    return code, err.getvalue()


@pytest.mark.parametrize("full_at", [4, 2])
def test_a_full_disk_at_a_checkpoint_says_so_in_one_line_and_keeps_what_was_saved(
    tmp_path, monkeypatch, full_at
):
    monkeypatch.setattr("paratrain.checkpoint.store.FileSystemWriter", full_disk_at(full_at))
    out = tmp_path / "run"
    code, err = train(tmp_path, out)
    assert code == 2, err
    assert "Traceback" not in err and "internal error" not in err, err
    lines = [line for line in err.splitlines() if "not saved" in line]
    partial = ck.checkpoint_path(out, full_at)
    assert lines == [
        f"paratrain train: error: checkpoint of step {full_at} not saved: No space left on "
        f"device ({partial}); its partial files were removed; earlier checkpoints and "
        "metrics.jsonl are kept"
    ], err
    assert not partial.exists()
    assert [c.step for c in ck.complete_checkpoints(out)] == ([2] if full_at == 4 else [])
    rows = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(row)["step"] for row in rows] == list(range(1, full_at + 1))


def test_the_cause_is_found_inside_dcps_report_and_an_exceptions_causes():
    full = OSError(errno.ENOSPC, "No space left on device")
    import traceback

    report = CheckpointException("write failed", {1: (full, traceback.StackSummary())})
    assert os_error_in(report) is full
    try:
        try:
            raise full
        except OSError as e:
            raise RuntimeError("a wrapper") from e
    except RuntimeError as wrapped:
        assert os_error_in(wrapped) is full
    assert os_error_in(RuntimeError("no file involved")) is None
