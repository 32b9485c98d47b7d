"""A run that ends inside its warm-up never reaches its peak learning rate: `train` and
`--dry-run` say so in one line, with the last rate; a run past its warm-up says nothing."""

from __future__ import annotations

from paratrain.cli import main
from paratrain.config import RunConfig
from paratrain.train.optim import learning_rate, warmup_note


def test_the_note_gives_the_last_steps_rate_and_the_peak():
    cfg = RunConfig()
    cfg.train.steps, cfg.train.warmup_steps, cfg.train.lr = 5, 100, 3e-3
    note = warmup_note(cfg)
    last = learning_rate(4, 3e-3, 100, 5, cfg.train.min_lr_ratio)
    assert note is not None and f"{last:.3g}" in note and "0.003" in note
    cfg.train.steps = 100  # the last warm-up step reaches the peak
    assert warmup_note(cfg) is None


def test_dry_run_shows_the_note(capsys):
    assert main(["train", "--steps", "5", "--warmup-steps", "100", "--dry-run"]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if "warm-up" in line]
    assert len(notes) == 1 and "--steps 5" in notes[0] and "--warmup-steps 100" in notes[0]
