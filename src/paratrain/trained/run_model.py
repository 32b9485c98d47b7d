"""A trained run, looked at in one process: `paratrain sample` (what the model writes) and
`paratrain eval` (its loss and perplexity on a data file).

The model is the run's latest checkpoint, whole (any mesh saved it: checkpoints hold
global tensors), in float32 on this process's device. Text goes through the run's
tokenizer: RUN_DIR/tokenizer/tokenizer.json when the run has one (an import's), read with
Hugging Face's `tokenizers`; otherwise bytes, the default data's encoding.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paratrain import checkpoint
from paratrain.checkpoint.whole_model import load_weights, read_model
from paratrain.config import RunConfig
from paratrain.config.toml_file import from_toml_text
from paratrain.data.chat_template import ChatTemplate, kept_template
from paratrain.data.document_rows import first_rows
from paratrain.data.prepared import is_prepared
from paratrain.data.supervised import prompt_ids, run_row_layout
from paratrain.data.tokenizer import EOT
from paratrain.data.tokens import load_tokens
from paratrain.models.generate import generate
from paratrain.token_rows import PAD, model_keywords, split_rows, target_count
from paratrain.train.build import build_model

TOKENIZER = Path("tokenizer") / "tokenizer.json"


def load_config(run_dir: Path) -> RunConfig:
    """The run's configuration, when it has a checkpoint to read weights from."""
    config = run_dir / "config.toml"
    if not config.is_file():
        raise ValueError(f"{run_dir}: no config.toml; give a paratrain run directory")
    if checkpoint.latest_checkpoint(run_dir) is None:
        raise ValueError(f"{run_dir}: no complete checkpoint (in {checkpoint.CHECKPOINTS}/)")
    cfg = from_toml_text(config.read_text())
    cfg.train = dataclasses.replace(cfg.train, init_from="")  # the run's own weights
    return cfg


def load_run(run_dir: Path) -> tuple[RunConfig, nn.Module]:
    """The run's configuration and its latest checkpoint's model, whole, in eval mode."""
    cfg = load_config(run_dir)
    ckpt = checkpoint.latest_checkpoint(run_dir)
    assert ckpt is not None  # load_config checked
    model = build_model(cfg)
    load_weights(model, read_model(ckpt.path), str(ckpt.path))
    return cfg, model.eval()


class Tokenizer:
    """The run's text <-> ids: its tokenizer.json, or bytes."""

    def __init__(self, run_dir: Path, vocab_size: int) -> None:
        self.file = run_dir / TOKENIZER
        self.hf: Any = None
        if self.file.is_file():
            from tokenizers import Tokenizer as HFTokenizer

            self.hf = HFTokenizer.from_file(str(self.file))
        elif vocab_size < 256:
            raise ValueError(f"{run_dir}: no {TOKENIZER} and a vocabulary below 256 bytes")

    @property
    def vocab(self) -> int:
        """Ids the tokenizer can decode: the model's rows beyond them are padding."""
        return self.hf.get_vocab_size() if self.hf else 256

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text).ids if self.hf else list(text.encode())

    def decode(self, ids: list[int]) -> str:
        if self.hf:
            return self.hf.decode(ids)
        return bytes(i for i in ids if i < 256).decode(errors="replace")


def sample(
    run_dir: Path,
    prompt: str,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int = 0,
    seed: int = 0,
    chat: bool = False,
) -> str:
    """The prompt and what the run's model writes after it (KV cache); with `chat`, the
    prompt is a user's message, rendered as the run's chat data were (chat_prompt), and
    the answer alone is returned, up to its end of turn."""
    if max_new_tokens < 1 or not temperature >= 0 or top_k < 0:
        raise ValueError(
            f"--max-new-tokens {max_new_tokens} must be positive, --temperature {temperature} "
            f"and --top-k {top_k} at least 0"
        )
    cfg, model = load_run(run_dir)
    tokenizer = Tokenizer(run_dir, cfg.model.vocab_size)
    ids, stop = chat_prompt(run_dir, tokenizer, prompt) if chat else (tokenizer.encode(prompt), -1)
    if not ids:
        raise ValueError("--prompt is empty; give at least one character")
    room = cfg.model.max_seq_len - len(ids)
    if cfg.model.arch == "gpt" and max_new_tokens > room:
        raise ValueError(
            f"--max-new-tokens {max_new_tokens}: the prompt takes {len(ids)} of the model's "
            f"{cfg.model.max_seq_len} positions; at most {max(room, 0)} remain"
        )
    generator = torch.Generator(device="cpu").manual_seed(seed)
    prompt_ids = torch.tensor([ids], dtype=torch.long, device="cpu")
    out = generate(
        model, prompt_ids, max_new_tokens, temperature, top_k, generator, vocab=tokenizer.vocab
    )[0].tolist()
    if not chat:
        return tokenizer.decode(out)
    answer = out[len(ids) :]
    return tokenizer.decode(answer[: answer.index(stop)] if stop in answer else answer)


def chat_prompt(run_dir: Path, tokenizer: Tokenizer, message: str) -> tuple[list[int], int]:
    """A user's message as the run's chat data were rendered (data/chat_template.py's
    kept_template: the template kept beside its tokenizer, or the default), with the
    generation prompt; and the id that ends the answer (the template's eos_token, or
    <|endoftext|>)."""
    if tokenizer.hf is None:
        raise ValueError(f"--chat needs a tokenizer; {run_dir} has no {TOKENIZER}")
    source = kept_template(run_dir / TOKENIZER.parent)
    template = ChatTemplate(source) if source is not None else None
    ids = prompt_ids([{"role": "user", "content": message}], tokenizer.hf, template)
    end = (source or {}).get("eos_token") or EOT
    stop = tokenizer.hf.token_to_id(end)
    if stop is None:
        raise ValueError(f"--chat: the tokenizer has no {end!r}, the answer's end")
    return ids, int(stop)


def held_out_tokens(cfg: RunConfig, run_dir: Path) -> torch.Tensor:
    """The held-out split the run itself validated on: its data, its split, its tokenizer."""
    d = cfg.data
    # A run keeps the tokenizer it trained with; without --tokenizer or a prepared data
    # set (which carries its own) it came with an imported model, and not from its data.
    if (run_dir / TOKENIZER).is_file() and not d.tokenizer and not is_prepared(d.path):
        raise ValueError(
            f"{run_dir} has no held-out split of its own (its model came with "
            f"{TOKENIZER}, not from training on --data); give --data"
        )
    if d.path and not Path(d.path).exists():
        raise ValueError(f"{run_dir} trained on --data {d.path!r}, not found here; give --data")
    return load_tokens(d.path, d.val_fraction, d.tokenizer).val[:].long()


def eval_tokens(cfg: RunConfig, run_dir: Path, data: str | None) -> torch.Tensor:
    """The ids `eval` scores: the run's own held-out split (no `data`), all of a text file
    (in the run's tokenizer) or a .bin, or a prepared directory's held-out split."""
    if data is None:
        tokens = held_out_tokens(cfg, run_dir)
    elif is_prepared(data):  # a prepared directory: its held-out documents
        tokens = load_tokens(data).val[:]
    else:  # all of the text (in the run's tokenizer) or ids: no split held out here
        tokenizer = run_dir / TOKENIZER
        text = tokenizer.is_file() and not data.endswith(".bin")  # a .bin holds ids already
        loaded = load_tokens(data, 0.0, str(tokenizer) if text else "")
        tokens = torch.cat([loaded.train, loaded.val]).long()
    what = f"--data {data!r}" if data is not None else f"{run_dir}'s held-out split"
    if tokens.numel() < 2:
        raise ValueError(f"{what}: fewer than 2 tokens")
    if int(tokens.max()) >= cfg.model.vocab_size:
        raise ValueError(
            f"{what} has token ids up to {int(tokens.max())}; the model's "
            f"vocabulary is {cfg.model.vocab_size}"
        )
    return tokens


def eval_seq_len(cfg: RunConfig, seq_len: int | None) -> int:
    n = seq_len or cfg.train.seq_len
    if n < 1 or (cfg.model.arch == "gpt" and n > cfg.model.max_seq_len):
        raise ValueError(f"--seq-len {n}: between 1 and the model's {cfg.model.max_seq_len}")
    return n


def eval_windows(tokens: torch.Tensor, n: int) -> torch.Tensor:
    """(W, n + 1) windows that overlap by one (each window's last token is the next one's
    first input), so that every token but the first is predicted exactly once; the last
    window's tail is padding (token_rows.PAD), no target of the loss."""
    windows = []
    for start in range(0, tokens.numel() - 1, n):
        piece = tokens[start : start + n + 1]
        padded = torch.full((n + 1,), PAD, dtype=torch.long, device="cpu")
        padded[: piece.numel()] = piece
        windows.append(padded)
    return torch.stack(windows)


def eval_rows(cfg: RunConfig, run_dir: Path, data: str | None, n: int) -> torch.Tensor:
    """The (W, n + 1) rows `eval` scores: where the run trained on whole documents
    (--packing none or documents, or auto on supervised data), every held-out document of
    a prepared data set, in rows as validation cut them; otherwise `eval_windows` of the
    ids."""
    source = data if data is not None else cfg.data.path
    if source and is_prepared(source):
        loaded = load_tokens(source)
        layout = run_row_layout(cfg, loaded.supervised)
        if layout != "stream" and loaded.documents is not None:
            lengths = loaded.documents["val"]
            if len(lengths) == 0:
                raise ValueError(f"--data {source!r} holds out no example to score")
            return first_rows(loaded.val, lengths, n, layout)
    return eval_windows(eval_tokens(cfg, run_dir, data), n)


@torch.no_grad()
def evaluate_file(
    run_dir: Path, data: str | None, seq_len: int | None = None, batch: int = 8
) -> dict[str, float]:
    """Mean next-token loss over a data file in one process (trained/mesh_eval.py: on a
    mesh), over eval_rows of seq_len + 1 tokens."""
    cfg, model = load_run(run_dir)
    n = eval_seq_len(cfg, seq_len)
    total, count = 0.0, 0
    for rows in eval_rows(cfg, run_dir, data, n).split(batch):
        valid = target_count(rows)
        total += float(model(*split_rows(rows), **model_keywords(rows))) * valid
        count += valid
    return scores(total / count, count)


def scores(loss: float, tokens: int) -> dict[str, float]:
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": tokens}
