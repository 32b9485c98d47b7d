"""Inputs a user gets wrong first (issue 30): binary data given as text, too little text for
the vocabulary asked, a refused `prepare` (nothing left behind), and prepare's progress bar
only on a terminal. Each refusal: exit 2, one line, nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from paratrain.cli import main
from paratrain.data.files import binary_reason

STDLIB_TEXT = Path(json.__file__).read_text()  # some kilobytes of real text


def refused(capsys, *argv: str) -> str:
    code = main(list(argv))
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_binary_given_as_text_is_refused_with_the_way_to_pass_ids(capsys, tmp_path):
    binary = tmp_path / "a.out"
    binary.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 64)
    err = refused(capsys, "train", "--data", str(binary), "--dry-run")
    assert "has NUL bytes" in err and ".bin of uint16" in err
    err = refused(capsys, "eval", str(tmp_path), "--data", str(binary))
    assert "has NUL bytes" in err


def test_text_with_a_little_invalid_utf8_is_still_text():
    text = STDLIB_TEXT.encode()
    assert binary_reason(text) is None
    assert binary_reason(text + "café".encode("latin-1")) is None  # one stray byte
    assert "invalid UTF-8" in binary_reason(bytes(range(128, 256)) * 8)
    assert binary_reason("é".encode()[:1]) is None  # a character cut at the sniff's end


def test_tokenizer_refuses_no_text_and_too_little_text(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    out = tmp_path / "tok.json"
    err = refused(
        capsys, "tokenizer", "train", "--data", str(tmp_path / "empty"), "--vocab-size", "512",
        "--out", str(out),
    )  # fmt: skip
    assert "holds no text" in err and not out.exists()
    small = tmp_path / "small.txt"
    small.write_text("the cat sat on the mat\n" * 3)
    base = ["tokenizer", "train", "--data", str(small), "--out", str(out)]
    err = refused(capsys, *base, "--vocab-size", "512")
    assert "fewer than --vocab-size 512" in err and not out.exists()


@pytest.fixture
def tokenizer(tmp_path) -> Path:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(STDLIB_TEXT)
    out = tmp_path / "tok.json"
    assert main(["tokenizer", "train", "--data", str(corpus), "--vocab-size", "300"] +
                ["--out", str(out)]) == 0  # fmt: skip
    return out


def test_refused_prepare_leaves_nothing_and_the_bar_is_for_terminals(capsys, tmp_path, tokenizer):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"title": "no text field"}\n')
    out = tmp_path / "data"
    base = ["prepare", "--tokenizer", str(tokenizer), "--out", str(out), "--workers", "1"]
    assert "needs a string field 'text'" in refused(capsys, *base, "--data", str(bad))
    assert not out.exists()
    refused(capsys, *base, "--data", str(tmp_path / "missing.txt"))
    assert not out.exists()
    good = tmp_path / "good.txt"
    good.write_text(STDLIB_TEXT)
    capsys.readouterr()
    assert main([*base, "--data", str(good)]) == 0
    captured = capsys.readouterr()
    assert "\r" not in captured.err and "wrote" in captured.out  # stderr is no terminal here
