"""`paratrain eval` and `paratrain sample` on an imported model, against transformers.

- eval over a .bin of token ids: the windows' mean token loss equals transformers' own loss
  (its `labels`) on the same windows, and perplexity is its exponential;
- sample at temperature 0 is transformers' greedy `generate`, decoded with the tokenizer
  that came with the import (a byte-level BPE trained here with `tokenizers`); at a
  temperature the same seed gives the same text and another seed another.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from paratrain.cli import main
from tests.test_hf import _gpt2, _import

N = 16  # window length (the model has 32 positions)


@pytest.fixture
def imported(tmp_path: Path) -> tuple[Path, Path]:
    hf_dir = _gpt2(tmp_path)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    text = Path(json.__file__).read_text()
    bpe.train_from_iterator([text], trainers.BpeTrainer(vocab_size=96, show_progress=False))
    bpe.save(str(hf_dir / "tokenizer.json"))
    _import(hf_dir, tmp_path / "run")
    return hf_dir, tmp_path / "run"


def test_eval_is_transformers_loss_over_the_same_windows(imported, tmp_path, capsys):
    hf_dir, run = imported
    ids = torch.randint(0, 96, (5 * N + 1,), generator=torch.Generator().manual_seed(5))
    data = tmp_path / "ids.bin"
    data.write_bytes(ids.to(torch.int16).numpy().tobytes())
    capsys.readouterr()
    assert main(["eval", str(run), "--data", str(data), "--seq-len", str(N), "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    windows = torch.stack([ids[i : i + N + 1] for i in range(0, 5 * N, N)])  # one shared token
    with torch.no_grad():
        expected = hf_model(windows, labels=windows).loss.item()  # all windows full: one mean
    assert result["tokens"] == 5 * N
    assert abs(result["loss"] - expected) < 1e-5
    assert abs(result["perplexity"] - math.exp(result["loss"])) < 1e-9


def test_sample_greedy_is_transformers_generate_decoded(imported, capsys):
    hf_dir, run = imported
    prompt = '{"key": '
    capsys.readouterr()
    args = ["sample", str(run), "--prompt", prompt, "--max-new-tokens", "8", "--temperature", "0"]
    assert main(args) == 0
    text = capsys.readouterr().out.rstrip("\n")
    tokenizer = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    hf_model.generation_config.eos_token_id = None
    ids = torch.tensor([tokenizer.encode(prompt).ids])
    out = hf_model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False, pad_token_id=0
    )
    assert text == tokenizer.decode(out[0].tolist())
    assert text.startswith(prompt)


def test_sampling_follows_its_seed(imported, capsys):
    _, run = imported

    def draw(seed: int) -> str:
        capsys.readouterr()
        args = ["sample", str(run), "--prompt", "{", "--max-new-tokens", "20", "--seed", str(seed)]
        assert main([*args, "--temperature", "1.0", "--top-k", "20"]) == 0
        return capsys.readouterr().out

    assert draw(1) == draw(1)
    assert draw(1) != draw(2)


def test_bad_sampling_flags_are_refused_in_one_line(imported, capsys):
    _, run = imported
    capsys.readouterr()
    assert main(["sample", str(run), "--prompt", "x", "--temperature", "nan"]) == 2
    assert "--temperature nan" in capsys.readouterr().err
    assert main(["sample", str(run), "--prompt", "x", "--max-new-tokens", "40"]) == 2
    assert "at most" in capsys.readouterr().err  # 32 positions in all


def test_eval_without_data_refuses_an_import_in_one_line(imported, capsys):
    _, run = imported
    capsys.readouterr()
    assert main(["eval", str(run), "--seq-len", str(N)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no held-out split of its own" in err[0] and "--data" in err[0]
