"""docs/reliability.md's table of bad inputs is what the checks print today (issue 21), and
its table of flags that matter only in some configurations is config.EFFECTS (issue 17):
scripts/bad_input_table.py runs every input, asserts each is refused in one line with
exit status 2 (before any worker, unless the row says a worker finds it) and that nothing
changed on disk, and the table it makes must equal the one in the docs. The fuzz test's
counts quoted there are its settings."""

from __future__ import annotations

from scripts import bad_input_table as bad

from tests import test_cli_fuzz as fuzz


def test_the_docs_tables_are_what_the_checks_print_and_config_effects_says():
    doc = bad.DOC.read_text()
    assert bad.with_tables(doc) == doc, (
        "docs/reliability.md's bad-input or effects table is stale: run "
        "`.venv/bin/python scripts/bad_input_table.py --write`"
    )


def test_the_docs_quote_the_fuzz_tests_counts():
    doc = " ".join(bad.DOC.read_text().split())
    flags = len(fuzz.NUMERIC_FLAGS) + len(fuzz.WORD_FLAGS)
    words = {6: "six"}
    assert f"{fuzz.COMMAND_LINES} random combinations per run" in doc
    assert f"of up to {words[fuzz.MAX_FLAGS]} flags among {flags}" in doc
    assert f"for {fuzz.TRAINED} random combinations of the optimizer's flags" in doc
