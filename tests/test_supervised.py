"""Supervised fine-tuning data (issue 34): `paratrain prepare --format chat|prompt-completion`
renders each example into ids and a loss mask that covers only the answer, the mask rides
in the ids (paratrain/token_rows.py: a token that is no target is stored as ~id), and
`--packing none` trains one example a row. The loss is the mean over the targets of the
whole global batch, whatever the layout: each layout equals one plain-PyTorch process to
the float64-derived tolerance (tests/equivalence.py), and masked tokens get no gradient.
"""

from __future__ import annotations

import contextlib
import io
import json
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from paratrain.cli import main
from paratrain.config import RunConfig
from paratrain.data.document_rows import DocumentRows, training_rows
from paratrain.data.supervised import render
from paratrain.data.tokenizer import EOT, load_tokenizer, train_tokenizer
from paratrain.data.tokens import TokenData, load_tokens
from paratrain.token_rows import PAD, split_rows, target_count
from tests.distributed import run_distributed
from tests.equivalence import References, assert_layout_equivalent, tiny_config, train_layouts

CORPUS = Path(json.__file__).parent


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_tokenizer(CORPUS, 400, out)
    return out


CHAT = {
    "messages": [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What does json.dumps return?"},
        {"role": "assistant", "content": "A string of JSON."},
        {"role": "user", "content": "And json.loads?"},
        {"role": "assistant", "content": "The Python object."},
    ]
}


def test_a_chat_trains_only_on_the_assistants_turns(tokenizer):
    tok = load_tokenizer(tokenizer)
    eot = tok.token_to_id(EOT)
    ids, mask = render(CHAT, "chat", tok, eot)
    assert len(ids) == len(mask)
    targets = [i for i, m in zip(ids, mask, strict=True) if m]
    answers = [tok.encode(t).ids + [eot] for t in ("A string of JSON.", "The Python object.")]
    assert targets == answers[0] + answers[1]
    shown = tok.decode([i for i, m in zip(ids, mask, strict=True) if not m])
    assert "What does json.dumps return?" in shown and "Answer briefly." in shown
    ids, mask = render({"prompt": "1 + 1 =", "completion": " 2"}, "prompt-completion", tok, eot)
    assert [i for i, m in zip(ids, mask, strict=True) if m] == tok.encode(" 2").ids + [eot]
    assert ids[: len(tok.encode("1 + 1 =").ids)] == tok.encode("1 + 1 =").ids


BAD = [
    ({"messages": [{"role": "user", "content": "hi"}]}, "chat", "has no assistant turn"),
    ({"messages": [{"role": "bot", "content": "hi"}]}, "chat", "needs a 'role' of system"),
    ({"messages": []}, "chat", "non-empty list 'messages'"),
    ({"prompt": "a"}, "prompt-completion", "string field 'completion'"),
]


@pytest.mark.parametrize("example, fmt, says", BAD, ids=[b[2] for b in BAD])
def test_a_bad_example_is_refused_with_its_line_and_nothing_is_left(
    example, fmt, says, tokenizer, tmp_path, capsys
):
    data = tmp_path / "chat.jsonl"
    good = json.dumps(CHAT if fmt == "chat" else {"prompt": "p", "completion": "c"})
    data.write_text(f"{good}\n{json.dumps(example)}\n")
    out = tmp_path / "out"
    argv = ["prepare", "--data", str(data), "--tokenizer", str(tokenizer), "--out", str(out)]
    assert main([*argv, "--format", fmt, "--workers", "1"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"{data}:2: " in line and says in line, line
    assert not out.exists()


def _chats(n: int) -> list[dict]:
    words = Path(textwrap.__file__).read_text().split()
    return [
        {"messages": [
            {"role": "user", "content": " ".join(words[i : i + 3 + i % 5])},
            {"role": "assistant", "content": " ".join(words[i + 9 : i + 11 + i % 7])},
        ]}
        for i in range(n)
    ]  # fmt: skip


@pytest.fixture(scope="module")
def prepared_chats(tokenizer, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("chats")
    data = root / "chats.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in _chats(60)))
    out = root / "sft"
    argv = ["prepare", "--data", str(data), "--tokenizer", str(tokenizer), "--out", str(out)]
    quiet = contextlib.redirect_stdout(io.StringIO())
    with quiet as printed:
        assert main([*argv, "--format", "chat", "--workers", "1", "--val-fraction", "0.2"]) == 0
    assert "chat examples" in printed.getvalue()
    return out


def test_prepared_chats_train_one_row_each_with_their_mask(tokenizer, prepared_chats):
    out = prepared_chats
    loaded = load_tokens(str(out))
    assert loaded.supervised and loaded.documents is not None
    lengths = loaded.documents["train"]
    assert int(lengths.sum()) == len(loaded.train)
    tok = load_tokenizer(tokenizer)
    answers = {c["messages"][1]["content"] for c in _chats(60)}
    rows = training_rows(loaded, "none", 64, 4, seed=0)
    assert isinstance(rows, DocumentRows)
    cut = 0
    for i, length in enumerate(lengths):  # each row one conversation, cut or padded
        row, start = rows.row(i), int(rows.starts[i])
        n = min(int(length), 65)
        assert torch.equal(row[:n], loaded.train[start : start + n])
        assert (row[n:] == PAD).all()
        doc = loaded.train[start : start + int(length)]
        answer = doc[doc >= 0].tolist()  # the whole example's targets: the answer and EOT
        assert answer[-1] == tok.token_to_id(EOT) and tok.decode(answer[:-1]) in answers
        cut += int(length) > 65
    assert 0 < cut < len(lengths)


def test_eval_scores_each_held_out_example_as_validation_cut_it(prepared_chats, tmp_path):
    """A run trained one example a row is evaluated on rows of its held-out examples, with
    their masks: the tokens scored are the answers' tokens within each row."""
    from paratrain.trained.run_model import evaluate_file

    run = tmp_path / "run"
    tiny = ["--n-layer", "1", "--d-model", "32", "--n-head", "2", "--seq-len", "64",
            "--global-batch", "4", "--micro-batch", "2", "--steps", "2",
            "--nproc", "1"]  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main(["train", *tiny, "--data", str(prepared_chats), "--out", str(run)]) == 0
    loaded = load_tokens(str(prepared_chats))
    lengths, starts = loaded.documents["val"], 0
    answers = 0
    for length in lengths:  # each row: the example's first 65 tokens; targets after the first
        row = loaded.val[starts : starts + min(int(length), 65)]
        answers += int((row[1:] >= 0).sum())
        starts += int(length)
    scored = evaluate_file(run, None)
    assert scored["tokens"] == answers > 0
    assert scored["loss"] == pytest.approx(evaluate_file(run, str(prepared_chats))["loss"])


def sft_data(n_train: int = 64, n_val: int = 8) -> TokenData:
    """Byte-level examples of 6-29 tokens, a prompt of 3-10 masked: some rows of 17 cut,
    most padded, and the micro-batches' target counts unequal."""
    text = Path(textwrap.__file__).read_bytes()
    g = torch.Generator(device="cpu").manual_seed(0)

    def split(n: int) -> tuple[torch.Tensor, np.ndarray]:
        docs = []
        for _ in range(n):
            prompt, answer = (
                int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in ((3, 11), (3, 20))
            )
            at = int(torch.randint(0, len(text) - 40, (1,), generator=g))
            doc = torch.tensor(list(text[at : at + prompt + answer]), dtype=torch.long)
            doc[:prompt] = torch.bitwise_not(doc[:prompt])
            docs.append(doc)
        return torch.cat(docs), np.array([len(d) for d in docs], dtype=np.int64)

    (train, train_docs), (val, val_docs) = split(n_train), split(n_val)
    documents = {"train": train_docs, "val": val_docs}
    return TokenData(train, val, 256, "sft", "byte examples", documents, True)


def sft_config(**parallel) -> RunConfig:
    """tiny_config's run at world 2 over one example a row, resolved as `train` resolves it."""
    from paratrain.validate import resolve_and_check

    cfg = tiny_config(steps=4)
    cfg.data.packing, cfg.parallel.nproc = "none", 2
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    return resolve_and_check(cfg, 2)


LAYOUTS = [dict(dp=2), dict(dp=2, zero=3), dict(pp=2), dict(tp=2), dict(cp=2)]


def test_every_layout_trains_sft_rows_as_one_process():
    """The mean over the global batch's targets, weighted across micro-batches, dp ranks,
    stages and context shards: each layout within the reference's derived tolerance."""
    data = sft_data()
    batch = training_rows(data, "none", 16, 8, 0).global_batch_at(0)
    counts = [target_count(part) for part in batch.chunk(4)]
    assert len(set(counts)) > 1 and (batch == PAD).any() and (batch < 0).any()
    configs = [sft_config(**layout) for layout in LAYOUTS]
    runs = [(c.parallel.dp, c.parallel.pp, c.parallel.tp, c) for c in configs]
    per_rank = run_distributed(train_layouts, 2, runs, data, timeout=600)
    references = References(data)
    for i, cfg in enumerate(configs):
        assert_layout_equivalent([r[i] for r in per_rank], cfg, data, None, references)


def test_masked_tokens_get_no_gradient():
    """The logits' gradient is exactly zero where the target is masked or padding, and not
    zero at every target."""
    from paratrain.models.registry import plain_model

    cfg = sft_config(dp=2)
    torch.manual_seed(0)
    model = plain_model(cfg.model)
    batch = training_rows(sft_data(), "none", 16, 8, 0).global_batch_at(0)
    logits = []
    model.head.register_forward_hook(lambda m, i, out: out.retain_grad() or logits.append(out))
    model(*split_rows(batch)).backward()
    grad = logits[0].grad.abs().sum(-1)  # (b, T)
    targets = batch[:, 1:] >= 0
    assert grad[~targets].eq(0).all() and grad[targets].gt(0).all()


def test_packing_none_needs_prepared_data(capsys):
    assert main(["train", "--packing", "none", "--steps", "1", "--dry-run"]) == 2
    assert "only a data set made by paratrain prepare" in capsys.readouterr().err
