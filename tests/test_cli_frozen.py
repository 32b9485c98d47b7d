"""The command line is frozen: every command's flags, defaults, choices and help are those
of docs/cli-reference.md, which scripts/cli_listing.py --write regenerates. A flag that
changes or disappears by accident fails here; a deliberate change is one --write and a
reviewed diff of that page."""

from __future__ import annotations

from scripts import cli_listing


def test_the_parser_is_the_checked_in_listing():
    assert cli_listing.listing() == cli_listing.DOC.read_text(), (
        "the command line differs from docs/cli-reference.md: if that is meant, run "
        "`.venv/bin/python scripts/cli_listing.py --write` and review the diff"
    )


def test_a_changed_flag_is_caught(monkeypatch):
    from paratrain import cli

    real = cli.build_parser

    def renamed():  # --steps spelled --step-count: the listing must differ
        parser = real()
        train = next(a for a in parser._actions if a.dest == "command").choices["train"]
        steps = next(a for a in train._actions if "--steps" in a.option_strings)
        steps.option_strings = ["--step-count"]
        return parser

    monkeypatch.setattr(cli, "build_parser", renamed)
    listed = cli_listing.listing()
    assert "`--step-count`" in listed and listed != cli_listing.DOC.read_text()
