"""Every path a run writes is checked before a worker starts (issue 30): an --out or a
--resume directory that cannot be written is refused in one line. /proc/x and a path
under a file are rows of docs/reliability.md's bad-input table (scripts/bad_input_table.py);
a read-only filesystem, which root cannot make here without mounting one, is a write that
fails with EROFS."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from paratrain.train import run_dir as rd


@pytest.fixture
def read_only(monkeypatch):
    """Writes fail as on a read-only mount (mkdir of an existing directory still passes)."""

    def refuse(self: Path, data: bytes) -> int:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))

    monkeypatch.setattr(Path, "write_bytes", refuse)


def test_an_empty_out_on_a_read_only_filesystem_is_refused(tmp_path, read_only):
    out = tmp_path / "empty"
    out.mkdir()
    with pytest.raises(ValueError) as refused:
        rd.prepare_run_dir(str(out))
    assert str(refused.value) == (
        f"--out '{out}' cannot be written: Read-only file system "
        f"({out}/.paratrain-write-check); give a directory that can be created and written"
    )
    assert list(out.iterdir()) == []


def test_a_resume_directory_on_a_read_only_filesystem_is_refused(tmp_path, read_only):
    with pytest.raises(ValueError, match=r"^--resume '.*' cannot be written: Read-only"):
        rd.check_writable(tmp_path, "--resume")


def test_a_writable_directory_passes_and_keeps_no_trace(tmp_path):
    assert rd.prepare_run_dir(str(tmp_path / "new")) == tmp_path / "new"
    assert list((tmp_path / "new").iterdir()) == []
