"""A tokenizer's own chat template (issue 34): `prepare --format chat` renders with the
chat_template of the tokenizer_config.json beside the tokenizer, exactly as transformers'
`apply_chat_template` renders it, and masks all but the assistant's turns; a template the
tokenizer lacks, or one that cannot be cut by turns, is refused in one line."""

from __future__ import annotations

import contextlib
import io
import json
import shutil

import pytest
import torch

from paratrain.cli import main
from paratrain.data.chat_template import KEPT, ChatTemplate, template_source
from paratrain.data.prepared import read_data_meta
from paratrain.data.supervised import prompt_ids, render
from paratrain.data.tokenizer import EOT, load_tokenizer
from tests.test_supervised import CHAT, tokenizer  # noqa: F401  (a fixture)

CHATML = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '"
    + EOT
    + "\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


@pytest.fixture()
def templated(tokenizer, tmp_path):  # noqa: F811
    """The test tokenizer in a directory whose tokenizer_config.json has CHATML."""
    shutil.copy(tokenizer, tmp_path / "tokenizer.json")
    settings = {"chat_template": CHATML, "eos_token": EOT}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(settings))
    return tmp_path / "tokenizer.json"


def test_the_tokenizers_template_renders_as_transformers_and_masks_the_answers(templated):
    from transformers import PreTrainedTokenizerFast

    source = template_source(templated, "auto")
    assert source is not None and source["template"] == CHATML
    pieces = ChatTemplate(source).pieces(CHAT["messages"])
    theirs = PreTrainedTokenizerFast(tokenizer_file=str(templated))
    theirs.chat_template = CHATML
    assert "".join(t for t, _ in pieces) == theirs.apply_chat_template(
        CHAT["messages"], tokenize=False
    )
    answers = [m["content"] + EOT + "\n" for m in CHAT["messages"] if m["role"] == "assistant"]
    assert [t for t, target in pieces if target] == answers
    tok = load_tokenizer(templated)
    ids, mask = render(CHAT, "chat", tok, tok.token_to_id(EOT), ChatTemplate(source))
    shown = [i for i, m in zip(ids, mask, strict=True) if m]
    assert tok.decode(shown, skip_special_tokens=False) == "".join(answers)


def test_default_is_used_where_the_tokenizer_has_no_template(tokenizer, tmp_path):  # noqa: F811
    assert template_source(tokenizer, "auto") is None
    assert template_source(tokenizer, "default") is None


def _prepare(tokenizer_file, tmp_path, *extra) -> tuple[int, str]:
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps(CHAT) + "\n")
    argv = ["prepare", "--data", str(data), "--tokenizer", str(tokenizer_file), "--format"]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main([*argv, "chat", "--workers", "1", "--out", str(tmp_path / "out"), *extra])
    return code, err.getvalue().strip()


def test_prepare_records_the_template_it_rendered_with(templated, tmp_path):
    assert _prepare(templated, tmp_path) == (0, "")
    assert read_data_meta(tmp_path / "out")["chat_template"] == "tokenizer"


def test_a_template_the_tokenizer_lacks_is_refused(tokenizer, tmp_path):  # noqa: F811
    code, line = _prepare(tokenizer, tmp_path, "--chat-template", "tokenizer")
    assert code == 2 and "has no chat_template" in line and "\n" not in line
    assert not (tmp_path / "out").exists()


def test_a_template_that_cannot_be_cut_by_turns_is_refused(templated, tmp_path):
    reversed_ = "{% for m in messages|reverse %}{{ m['content'] }}{% endfor %}"
    settings = templated.parent / "tokenizer_config.json"
    settings.write_text(json.dumps({"chat_template": reversed_}))
    code, line = _prepare(templated, tmp_path)
    assert code == 2 and "prefixes" in line and "\n" not in line


@pytest.mark.parametrize("with_template", [True, False], ids=["tokenizer", "default"])
def test_sample_prompts_are_cut_as_training_cut_the_conversation(templated, with_template):
    """`sample --chat`'s ids for a user's message are exactly the training ids of a
    conversation with that message, up to its answer's first target."""
    tok = load_tokenizer(templated)
    template = ChatTemplate(template_source(templated, "auto")) if with_template else None
    chat = {"messages": [CHAT["messages"][1], CHAT["messages"][2]]}  # user, assistant
    ids, mask = render(chat, "chat", tok, tok.token_to_id(EOT), template)
    first = mask.index(1)
    assert prompt_ids(chat["messages"][:1], tok, template) == ids[:first]


def test_sample_chat_answers_with_the_template_the_data_was_prepared_with(templated, tmp_path):
    """prepare keeps the template beside the data, train beside the run's tokenizer, and
    `sample --chat` renders the message with it and prints the greedy answer up to the
    template's end of turn (recomputed here from the model and the ids)."""
    from paratrain.models.generate import generate
    from paratrain.trained.run_model import load_run

    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(CHAT) + "\n" for _ in range(40)))
    prepared, run = tmp_path / "data", tmp_path / "run"
    tiny = ["--n-layer", "1", "--d-model", "32", "--n-head", "2", "--seq-len", "64",
            "--global-batch", "4", "--micro-batch", "2", "--steps", "3",
            "--nproc", "1"]  # fmt: skip
    quiet = contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO())
    with quiet[0], quiet[1]:
        argv = ["prepare", "--data", str(data), "--tokenizer", str(templated), "--out"]
        assert main([*argv, str(prepared), "--format", "chat", "--workers", "1"]) == 0
        assert main(["train", *tiny, "--data", str(prepared), "--out", str(run)]) == 0
    assert json.loads((run / "tokenizer" / KEPT).read_text())["template"] == CHATML
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        argv = ["sample", str(run), "--chat", "--prompt", "And json.loads?"]
        assert main([*argv, "--temperature", "0", "--max-new-tokens", "12"]) == 0
    tok = load_tokenizer(templated)
    ids = prompt_ids([{"role": "user", "content": "And json.loads?"}], tok, ChatTemplate(
        template_source(templated, "auto")))  # fmt: skip
    _, model = load_run(run)
    out = generate(model, torch.tensor([ids]), 12, vocab=tok.get_vocab_size())[0, len(ids) :]
    answer = out.tolist()
    stop = tok.token_to_id(EOT)
    answer = answer[: answer.index(stop)] if stop in answer else answer
    assert printed.getvalue() == tok.decode(answer) + "\n"
