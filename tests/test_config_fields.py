"""The fields' facts drive the checks, the help and the automatic fields (config/fields.py).

Every field that states `choices=` or a bound is tried with a value outside it, through
`paratrain train --dry-run` as a user types it: refused with exit status 2, in one line
that starts with the flag. A fact that no check reads (a bound the range check skipped, a
choice set left out of the loop) fails here for each field that states it, without a line
per field in this file.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from paratrain.cli import main
from paratrain.commands.config_flags import help_line
from paratrain.config import FIELDS, RunConfig, every_field, resolve
from paratrain.config.fields import Facts, in_range, range_words


@pytest.fixture(autouse=True)
def _in_a_temporary_directory(tmp_path, monkeypatch):
    """A bad input that slipped through would start training: keep its run dir out of the repo."""
    monkeypatch.chdir(tmp_path)


def outside(kind: type, facts: Facts) -> list[Any]:
    """Values just outside each fact the field states: one per choice set and per bound."""
    values: list[Any] = []
    if facts.choices is not None:
        values.append("bogus" if kind is str else max(facts.choices) + 1)
    below_low = [facts.at_least - 1 if facts.at_least is not None else None, facts.above]
    above_high = [facts.at_most + 1 if facts.at_most is not None else None, facts.below]
    values += [kind(v) for v in below_low + above_high if v is not None]
    return values


CASES = [
    pytest.param(entry.flag, value, id=f"{entry.flag}={value}")
    for entry in every_field()
    for value in outside(entry.kind, entry.facts)
]


def test_the_facts_are_stated_where_they_should_be():
    """Not an empty parametrization: the counts, the choice sets and the ranges are there."""
    with_choices = {k for k, e in FIELDS.items() if e.facts.choices is not None}
    with_range = {k for k, e in FIELDS.items() if range_words(e.facts) is not None}
    assert {"parallel.schedule", "parallel.zero", "train.dtype", "model.arch"} <= with_choices
    assert {"train.steps", "train.lr", "model.dropout", "data.val_fraction"} <= with_range
    assert len(CASES) >= len(with_choices) + len(with_range) > 50


@pytest.mark.parametrize("flag, value", CASES)
def test_a_value_outside_a_fields_facts_is_refused_naming_its_flag(flag, value, capsys):
    code = main(["train", "--dry-run", f"{flag}={value}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"paratrain train: error: {flag} "), err
    assert "; valid: " in err or " must be " in err, err


def test_a_config_files_value_is_refused_naming_the_flag(tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_text('[parallel]\nschedule = "pipedream"\n')
    assert main(["train", "--dry-run", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "--schedule 'pipedream'; valid: gpipe, 1f1b, interleaved, zb-h1" in err


@pytest.mark.parametrize(
    "facts, inside, outside_it, words",
    [
        (Facts("", at_least=1), [1, 5], [0, -1], "at least 1"),
        (Facts("", above=0), [1e-30], [0, -1, float("nan")], "positive"),
        (Facts("", at_least=0), [0, 2], [-1, float("nan")], "0 or more"),
        (Facts("", at_least=0, below=1), [0, 0.5], [1, -0.1, float("nan")], "in [0, 1)"),
        (Facts("", above=0, below=1), [0.5], [0, 1], "in (0, 1)"),
        (Facts("", at_least=0, at_most=1), [0, 1], [1.5], "in [0, 1]"),
        (Facts(""), [float("nan"), -(10**9)], [], None),
    ],
)
def test_ranges_and_their_words(facts, inside, outside_it, words):
    assert all(in_range(facts, v) for v in inside)
    assert not any(in_range(facts, v) for v in outside_it)
    assert range_words(facts) == words


def test_help_lists_choices_and_presets_and_each_default_once():
    lines = {entry.key: help_line(entry) for entry in every_field()}
    assert lines["parallel.schedule"] == (
        "Pipeline schedule. (choices: gpipe, 1f1b, interleaved, zb-h1; default: 1f1b)"
    )
    assert "choices: gpt-tiny, gpt2-124m, llama-tiny, moe-tiny" in lines["model.name"]
    assert lines["train.out"] == "Run directory. (default: runs/<date>-<time>)"
    for key, line in lines.items():
        assert line.count("default") - FIELDS[key].facts.help.count("default") == 1, line
        assert "''" not in line, line  # an empty string says nothing: the facts say what it means


def test_resolve_fills_a_copy_and_refuses_nothing():
    cfg = RunConfig()
    cfg.train.global_batch, cfg.train.microbatches = 0, 3
    resolved = resolve(cfg, 4, cuda=False)
    assert (resolved.parallel.dp, resolved.train.global_batch) == (4, 3 * 8 * 4)
    assert (resolved.parallel.device, resolved.parallel.backend, resolved.train.dtype) == (
        "cpu",
        "gloo",
        "float32",
    )
    assert cfg == dataclasses.replace(RunConfig(), train=cfg.train)  # the input unchanged
    assert cfg.parallel.dp == 0 and cfg.parallel.device == "auto"
    on_gpus = resolve(RunConfig(), 2, cuda=True)
    assert (on_gpus.parallel.backend, on_gpus.train.dtype) == ("nccl", "bfloat16")
    cfg.parallel.tp = 3  # 4 ranks: no dp fits; left for the checks to name
    assert resolve(cfg, 4, cuda=False).parallel.dp == 0


def test_check_runs_every_rule_defined_in_a_rules_module():
    """A new rules_<concern>.py function that check.py forgot would refuse nothing."""
    import importlib
    import pkgutil

    import paratrain.validate as validate
    from paratrain.validate.check import RULES

    defined = set()
    for info in pkgutil.iter_modules(validate.__path__):
        if info.name.startswith("rules_"):
            module = importlib.import_module(f"paratrain.validate.{info.name}")
            defined |= {
                name
                for name, value in vars(module).items()
                if name.endswith("_rules") and getattr(value, "__module__", "") == module.__name__
            }
    called_with_sizes = {"device_rules", "mesh_rules"}  # check() passes them the sizes
    assert defined == {rule.__name__ for rule in RULES} | called_with_sizes
