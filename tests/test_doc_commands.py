"""Every `paratrain ...` command in README.md and docs/*.md runs (issue 30), so that no
example goes stale: training layouts with --dry-run (the same checks as a run, no worker),
the planner and the schedule simulator for real (cheap), and the rest parsed, each with
the reason it is not run (a benchmark takes minutes; a run the doc made before is not
here). Inline `paratrain ...` spans in prose are parsed. All in this process, in a
temporary directory, so that nothing the examples write lands in the checkout."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from paratrain.cli import _parse, build_parser, main

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md"))]
GENERATED = {"cli-reference.md"}  # the flags' listing, tests/test_cli_frozen.py checks it
# A span in prose that is a pattern, not a command: a placeholder (RUN, N, NAME), an
# alternative (ring|alltoall), an elision, optional parts, a quoted refusal, or a quoted
# message (`paratrain train: stopped by ...`: a command's name and a colon).
PATTERN = re.compile(r"\.\.\.|\||\[|error:|^paratrain [\w-]+:|(?:^|\s)[A-Z][A-Z_]*(?:\s|$)")


@dataclass(frozen=True)
class DocCommand:
    where: str  # README.md:133
    argv: tuple[str, ...]  # after `paratrain`
    fenced: bool  # in a code block (a command to run), or a span in prose


def _argv(text: str) -> tuple[str, ...] | None:
    """The arguments after `paratrain`: no comment, pipe or environment prefix."""
    text = text.split(" | ")[0]
    try:
        words = shlex.split(text, comments=True)
    except ValueError:
        return None
    while words and "=" in words[0] and words[0] != "paratrain":  # OMP_NUM_THREADS=1
        words.pop(0)
    if not words or words[0] != "paratrain":
        return None
    return tuple(w.replace("$STDLIB", "/usr/lib/python3") for w in words[1:])


def doc_commands() -> list[DocCommand]:
    found = []
    for doc in DOCS:
        if doc.name in GENERATED:
            continue
        lines, fence, i = doc.read_text().splitlines(), False, 0
        while i < len(lines):
            line, where = lines[i], f"{doc.relative_to(ROOT)}:{i + 1}"
            i += 1
            if line.lstrip().startswith("```"):
                fence = not fence
                continue
            if fence:
                text = line.strip().removeprefix("$ ")
                while text.endswith("\\") and i < len(lines):  # a continued line
                    text, i = text[:-1] + " " + lines[i].strip(), i + 1
                argv = _argv(text) if "paratrain " in text else None
                if argv is not None:
                    found.append(DocCommand(where, argv, fenced=True))
                continue
            for span in re.findall(r"`(paratrain [^`]+)`", line):
                argv = _argv(span)
                if argv is not None and not PATTERN.search(span):
                    found.append(DocCommand(where, argv, fenced=False))
    return found


def not_run(c: DocCommand) -> str | None:
    """Why a fenced command is parsed but not run, or None to run it."""
    name, flags = c.argv[0] if c.argv else "", set(c.argv)
    if name == "bench":
        return "a benchmark: minutes of timed pairs"
    if name == "simulate":
        return (
            "full-size ranks, a minute or more each (docs/planner.md's table); "
            "tests/test_simulate.py runs layouts at world 64-128 on a small model"
        )
    if name == "plan" and "--validate" in flags:
        return "trains small layouts; tests/test_plan_cli.py runs its cases"
    if name in ("export", "sample", "eval"):
        return "needs the run an earlier command trained"
    if name in ("import-hf", "tokenizer", "prepare"):
        return "needs the user's files (docs/models.md's worked example was run as shown)"
    if name == "train" and flags & {"--resume", "--init-from", "--config", "--data"}:
        return "needs a run, a config file or data an earlier step made"
    return None


COMMANDS = doc_commands()


def test_the_docs_have_commands_of_every_kind():
    names = {c.argv[0] for c in COMMANDS if c.fenced}
    assert {"train", "plan", "bench", "schedule", "export", "eval", "sample"} <= names
    assert len([c for c in COMMANDS if c.fenced and not_run(c) is None]) > 40


@pytest.mark.parametrize("c", COMMANDS, ids=[f"{c.where} {' '.join(c.argv)}" for c in COMMANDS])
def test_documented_command(c, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # what an example writes (--out zb.png) lands here
    runs = c.fenced and not_run(c) is None
    if not runs or "--help" in c.argv:
        _parse_or_explain(c, capsys)
        return
    argv = list(c.argv) + (["--dry-run"] if c.argv[0] == "train" else [])
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 0, f"{c.where}: paratrain {' '.join(argv)} exited {code}: {err}"


def _parse_or_explain(c: DocCommand, capsys) -> None:
    try:
        _parse(build_parser(), list(c.argv))
    except SystemExit as e:
        err = capsys.readouterr().err
        if e.code == 0:  # --help
            return
        if not c.fenced and ("expected one argument" in err or "are required" in err):
            return  # a span naming a flag or command in prose (`paratrain train --tp`)
        said = f"{c.where}: paratrain {' '.join(c.argv)} does not parse: {err}"
        raise AssertionError(said) from None
