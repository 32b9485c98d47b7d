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

from paratrain.cli import main
from paratrain.data.chat_template import ChatTemplate, template_source
from paratrain.data.prepared import read_data_meta
from paratrain.data.supervised import render
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
