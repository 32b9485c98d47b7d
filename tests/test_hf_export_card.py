"""`paratrain export --format hf` carries what feeding the model needs (issue 30): config.json
has bos/eos/pad ids from the run's tokenizer (or the byte-level ones: no bos/eos, pad 0),
the tokenizer's files go along (a byte-level tokenizer.json for a byte-level run), and
README.md says how to feed it. Small random models built with transformers, nothing
downloaded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import transformers

from paratrain.cli import main
from paratrain.data.tokenizer import EOT


def _imported(tmp: Path, vocab: int) -> Path:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=vocab, n_positions=32, n_embd=32, n_layer=1, n_head=4
    )
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp / "hf")
    assert main(["import-hf", str(tmp / "hf"), "--out", str(tmp / "run")]) == 0
    return tmp / "run"


def _export(run: Path) -> Path:
    out = run.parent / "exported"
    assert main(["export", str(run), "--format", "hf", "--out", str(out)]) == 0
    return out


def test_a_byte_level_export_says_ids_are_bytes(tmp_path):
    out = _export(_imported(tmp_path, vocab=256))
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (
        None,
        None,
        0,
    )  # not GPT2Config's default 50256, outside a vocabulary of 256
    tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "def é\n"
    assert tok(text).input_ids == list(text.encode()) and tok.decode(list(text.encode())) == text
    assert tok.pad_token_id == 0
    card = (out / "README.md").read_text()
    assert "raw UTF-8 bytes, token id = byte value" in card and "list(prompt.encode())" in card
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.generation_config.eos_token_id is None


def test_a_bpe_export_carries_its_tokenizer_and_its_end_of_text_id(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(Path(json.__file__).read_text())
    tokenizer = tmp_path / "tok.json"
    argv = ["tokenizer", "train", "--data", str(corpus), "--vocab-size", "300"]
    assert main([*argv, "--out", str(tokenizer)]) == 0
    run = _imported(tmp_path, vocab=384)
    (run / "tokenizer").mkdir()
    shutil.copy(tokenizer, run / "tokenizer" / "tokenizer.json")  # what `train` keeps
    out = _export(run)
    config = json.loads((out / "config.json").read_text())
    tok = transformers.AutoTokenizer.from_pretrained(out)
    eot = tok.convert_tokens_to_ids(EOT)
    assert config["eos_token_id"] == config["bos_token_id"] == config["pad_token_id"] == eot
    assert tok.eos_token_id == eot and tok("def x").input_ids
    assert f"eos {eot}" in (out / "README.md").read_text()


def test_an_import_without_its_tokenizer_claims_no_special_ids(tmp_path):
    out = _export(_imported(tmp_path, vocab=384))  # not bytes, and no tokenizer came along
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (
        None,
        None,
        None,
    )
    assert not (out / "tokenizer.json").exists()
    assert "feed the ids of the tokenizer the data was made with" in (out / "README.md").read_text()
