"""docs/reliability.md's table of mode combinations is what the checks accept and refuse
today, and every combination it marks supported names tests that exist and train it
(issue 17: "for every mode and flag combination, what is supported and what is refused;
no claim without its test"). scripts/combination_table.py runs every pair through
`paratrain train` with the launcher and the worker replaced by tripwires."""

from __future__ import annotations

import pytest
from scripts import combination_table as table


def test_the_docs_combination_table_is_what_the_checks_accept_and_refuse():
    doc = table.DOC.read_text()
    assert table.with_table(doc, table.table()) == doc, (
        "docs/reliability.md's combination table is stale: run "
        "`.venv/bin/python scripts/combination_table.py --write`"
    )


def test_every_test_the_table_names_exists_and_a_missing_one_is_caught(monkeypatch):
    assert table.missing_tests() == []
    wrong = {
        "test_composition.py::test_layouts_match_single_process[3]": [],  # no such id
        "test_composition.py::test_layouts_are_fine": [],  # no such function
        "test_nowhere.py::test_x": [],  # no such file
    }
    monkeypatch.setattr(table, "COVERAGE", {**table.COVERAGE, **wrong})
    assert table.missing_tests() == list(wrong)


def test_an_accepted_combination_without_a_test_fails_the_generation(monkeypatch):
    """A claim needs its test: accepted and neither in COVERAGE nor in UNTESTED fails, and
    so does an UNTESTED entry that a test covers (the list must shrink as tests come)."""
    found = {("dp", "tp"): None, ("tp", "bf16"): None, ("async", "tp"): "refused"}
    dp_tp = {"test_composition.py::test_layouts_match_single_process[8]": [{"dp", "tp"}]}
    monkeypatch.setattr(table, "COVERAGE", dp_tp)  # only dp x tp, whatever the real one holds
    monkeypatch.setattr(table, "UNTESTED", set())
    with pytest.raises(AssertionError, match=r"untested, not listed: \[\('tp', 'bf16'\)\]"):
        table.table(found)
    monkeypatch.setattr(table, "UNTESTED", {("tp", "bf16"), ("dp", "tp")})
    with pytest.raises(AssertionError, match=r"listed but tested or refused: \[\('dp', 'tp'\)\]"):
        table.table(found)
    monkeypatch.setattr(table, "UNTESTED", {("tp", "bf16")})
    assert "| dp × tp | `test_composition.py::" in table.table(found)
