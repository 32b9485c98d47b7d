"""What a user sees while training (issue 30): on a terminal one live bar of rank 0 (step,
loss, tokens/s, ETA) that log lines do not split; off a terminal a line every --log-every
steps. The terminal test runs the real launcher in a pseudo-terminal of 0 x 0 (what
`script -qec CMD /dev/null` reports under a pipe, where tqdm alone draws nothing)."""

from __future__ import annotations

import io
import logging
import re
import sys

import pytest

from paratrain.train.metrics import StepMetrics
from paratrain.train.progress import Progress
from tests.distributed import under_nccl_order
from tests.terminal import Terminal, screen_lines

TINY = [
    "--n-layer", "1", "--d-model", "32", "--n-head", "2", "--seq-len", "32",
    "--global-batch", "4", "--micro-batch", "2", "--val-batches", "1", "--nproc", "2",
]  # fmt: skip


def paratrain_in_terminal(argv: list[str], cwd, rows: int = 0, columns: int = 0) -> Terminal:
    command = [sys.executable, "-m", "paratrain", *under_nccl_order(argv, cwd)]
    return Terminal(command, cwd, rows, columns)


@pytest.mark.e2e
def test_a_terminal_shows_one_live_bar_that_log_lines_do_not_split(tmp_path):
    out = tmp_path / "run"
    run = ["train", *TINY, "--steps", "6", "--checkpoint-every", "3", "--log-every", "1"]
    code, output = paratrain_in_terminal([*run, "--out", str(out)], tmp_path).finish()
    assert code == 0, output
    lines = screen_lines(output)
    final = r"step 6/6 \|.+\| \d\d:\d\d<00:00 ETA, loss=\d+\.\d{4}, tok_s=[\d,]+ *"
    assert any(re.fullmatch(final, line) for line in lines), output
    for step in (3, 6):  # rank 0's own lines while the bar is live: each on a line of its own
        assert any(line.startswith(f"checkpoint step {step}: ") for line in lines), output
    assert not re.search(r"step \d/6  loss", output), "log lines beside the bar"
    assert lines[-2].startswith("trained 6 steps on 2 processes"), output


def _metrics(step: int) -> StepMetrics:
    return StepMetrics(step, 5.0, 1e-3, 1000.0, 1.0, 0.1, 0.1, 0.0, 0.0)


@pytest.mark.parametrize(("first", "logged"), [(0, [1, 2, 4, 6]), (3, [4, 6])])
def test_off_a_terminal_a_line_every_log_every_steps_and_the_first_and_last(caplog, first, logged):
    progress = Progress(6, log_every=2, enabled=True, first_step=first, stream=io.StringIO())
    with caplog.at_level(logging.INFO, logger="paratrain.train.progress"):
        for step in range(first + 1, 7):
            progress.update(_metrics(step))
    progress.close()
    assert progress.bar is None
    assert [int(m.split()[1].split("/")[0]) for m in caplog.messages] == logged


def test_the_bar_follows_a_resized_terminal(tmp_path):
    """Drawn into a real pseudo-terminal whose window is narrowed between two steps: the
    next frame fills the new width (it kept the width it started with before)."""
    import os
    import select

    from tests.terminal import resize

    master, slave = os.openpty()
    resize(master, 24, 100)
    stream = os.fdopen(slave, "w")
    try:
        progress = Progress(6, log_every=1, enabled=True, stream=stream)
        progress.update(_metrics(1))
        resize(master, 24, 60)
        progress.update(_metrics(2))
        progress.close()
        stream.flush()
        chunks = []
        while select.select([master], [], [], 1.0)[0]:  # all that was drawn, however split
            chunks.append(os.read(master, 1 << 16))
        drawn = b"".join(chunks).decode()
    finally:
        stream.close()
        os.close(master)
    frames = [f.replace("\x1b[K", "").rstrip() for f in drawn.replace("\n", "\r").split("\r")]
    widths = {int(f.split("/")[0].split()[-1]): len(f) for f in frames if f.startswith("step ")}
    assert widths[1] == 100 and widths[2] == 60, frames
