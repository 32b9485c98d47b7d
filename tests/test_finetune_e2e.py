"""Fine-tuning end to end (issue 34), as a user runs it, at small size and nothing
downloaded: a Llama built with transformers and saved with a tokenizer whose
tokenizer_config.json has a chat template; `import-hf`; chat data made here, prepared with
that template; a LoRA fine-tune at dp 2 x tp 2 with ZeRO-3 over packed conversations;
`eval` on the held-out conversations (the answers' tokens only); `sample --chat`; `export
--format hf --merge-lora`; and transformers' greedy generation from the merged export equal
to ours (float64 on both sides: the export's one float32 rounding is applied to ours too,
as tests/test_lora_export.py does, so the logits agree to 1e-10 and no near tie can flip a
token).
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import textwrap
from pathlib import Path

import pytest
import torch
import transformers

from paratrain.cli import main
from paratrain.data.chat_template import ChatTemplate, kept_template
from paratrain.data.supervised import prompt_ids
from paratrain.data.tokenizer import EOT, load_tokenizer, train_tokenizer
from paratrain.data.tokens import load_tokens
from paratrain.models.generate import generate
from paratrain.trained.run_model import load_run
from tests.test_chat_template import CHATML
from tests.test_hf import float64_oracle as float64_oracle  # transformers' RMSNorm in float64
from tests.test_lora_export import _merged_as_exported

pytestmark = pytest.mark.e2e
VOCAB = 400  # the tokenizer's; divisible by tp 2


def _hf_llama_with_chat_tokenizer(tmp: Path) -> Path:
    out = tmp / "hf"
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=False, rms_norm_eps=1e-5,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(out)
    train_tokenizer(Path(json.__file__).parent, VOCAB, out / "tokenizer.json")
    settings = {"chat_template": CHATML, "eos_token": EOT}
    (out / "tokenizer_config.json").write_text(json.dumps(settings))
    return out


def _chats(path: Path, n: int) -> None:
    words = Path(textwrap.__file__).read_text().split()
    lines = []
    for i in range(n):
        user = " ".join(words[i : i + 3 + i % 4])
        answer = " ".join(words[i + 7 : i + 9 + i % 5])
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        lines.append(json.dumps({"messages": messages}) + "\n")
    path.write_text("".join(lines))


def _cli(*argv: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert main(list(argv)) == 0, argv
    return out.getvalue()


def test_a_lora_chat_fine_tune_from_import_to_transformers_generation(tmp_path):
    hf = _hf_llama_with_chat_tokenizer(tmp_path)
    _cli("import-hf", str(hf), "--out", str(tmp_path / "base"))
    _chats(tmp_path / "chats.jsonl", 80)
    data, run = tmp_path / "data", tmp_path / "run"
    _cli("prepare", "--data", str(tmp_path / "chats.jsonl"), "--tokenizer",
         str(hf / "tokenizer.json"), "--format", "chat", "--val-fraction", "0.2",
         "--workers", "1", "--out", str(data))  # fmt: skip
    _cli("train", "--init-from", str(tmp_path / "base"), "--data", str(data),
         "--lora-rank", "4", "--lora-alpha", "8", "--nproc", "4", "--dp", "2", "--tp", "2",
         "--zero", "3", "--seq-len", "120", "--global-batch", "8", "--micro-batch", "2",
         "--steps", "4", "--lr", "3e-2", "--out", str(run))  # fmt: skip

    # eval scores the held-out answers (and their end of turn) only: packed rows of whole
    # conversations, each opening with a prompt that is no target
    loaded = load_tokens(str(data))
    assert max(loaded.documents["val"]) <= 121  # no conversation is cut
    scored = json.loads(_cli("eval", str(run), "--json").strip().splitlines()[-1])
    assert scored["tokens"] == int((loaded.val[:] >= 0).sum()) > 0

    answer = _cli("sample", str(run), "--chat", "--prompt", "what is wrapped?",
                  "--temperature", "0", "--max-new-tokens", "6")  # fmt: skip
    assert answer.endswith("\n") and EOT not in answer

    _cli("export", str(run), "--format", "hf", "--merge-lora", "--out", str(tmp_path / "out"))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", dtype=torch.float64
    ).eval()
    tok = load_tokenizer(hf / "tokenizer.json")
    template = ChatTemplate(kept_template(run / "tokenizer"))
    ids = torch.tensor([prompt_ids([{"role": "user", "content": "what is wrapped?"}], tok,
                                   template)])  # fmt: skip
    _, ours = load_run(run)
    ours = _merged_as_exported(ours.double()).eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, rtol=0, atol=1e-10)
        mine = generate(ours, ids, 12)
        their_ids = theirs.generate(
            ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    assert torch.equal(mine, their_ids)
    shutil.rmtree(tmp_path / "out")
