"""Every count a bench takes (steps, rounds, ranks, sizes, repeats) is refused by the
parser below 1: exit 2, one line naming the flag, before anything runs."""

from __future__ import annotations

import argparse

import pytest

from paratrain.commands.bench_flags import add_arguments, count
from tests.test_cli_main import refused


def _count_flags() -> list[tuple[str, str]]:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return [
        (name, action.option_strings[0])
        for name, sub in subparsers.choices.items()
        for action in sub._actions
        if action.type is count
    ]


COUNT_FLAGS = _count_flags()


def test_the_benches_take_their_counts_as_counts():
    assert ("overhead", "--steps") in COUNT_FLAGS and ("muon", "--every") in COUNT_FLAGS
    assert len(COUNT_FLAGS) >= 19


@pytest.mark.parametrize("bench, flag", COUNT_FLAGS)
def test_a_count_below_one_is_refused_in_one_line(bench, flag, capsys):
    err = refused(capsys, "bench", bench, flag, "0")
    assert flag in err and "at least 1" in err, err
