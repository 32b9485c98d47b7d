"""Supervised examples (`paratrain prepare --format chat|prompt-completion`): one JSON
line each, rendered into token ids and a loss mask that covers only what the model is to
learn to answer.

- chat: `{"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}`,
  rendered with the tokenizer's own chat template where it has one (data/chat_template.py:
  the assistant's turns, with the template's end of turn, are the targets), else with the
  default template (TEMPLATE_DOC): each message is a header line naming its role, then
  its content; a system or user message ends with a newline, an assistant message with
  `<|endoftext|>`. Only the assistant's content and its `<|endoftext|>` are loss targets.
- prompt-completion: `{"prompt": "...", "completion": "..."}`: the prompt, then the
  completion and `<|endoftext|>`, which alone are targets.

Each piece is encoded on its own and the ids joined, so a piece's tokens never merge with
its neighbour's and the mask falls on token boundaries.
"""

from __future__ import annotations

from typing import Any

import numpy as np

FORMATS = ("text", "chat", "prompt-completion")
ROLES = ("system", "user", "assistant")
TEMPLATE_DOC = "<|ROLE|>\\nCONTENT\\n per message; the assistant's CONTENT<|endoftext|>"


def _string(doc: dict[str, Any], key: str, what: str) -> str:
    value = doc.get(key)
    if not isinstance(value, str):
        raise ValueError(f"{what} needs a string field {key!r}")
    return value


def _pieces_of_chat(doc: dict[str, Any], template: Any) -> list[tuple[str, bool]]:
    """(text, is a target) pieces of one conversation: the default template's without
    the closing tokens, or a tokenizer's template's (data/chat_template.py) with its own."""
    messages = doc.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("a chat example needs a non-empty list 'messages'")
    pieces: list[tuple[str, bool]] = []
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ValueError(f"a message needs a 'role' of {', '.join(ROLES)}; got {m!r:.60}")
        content = _string(m, "content", "a message")
        pieces.append((_header(m["role"]), False))
        pieces.append((content, m["role"] == "assistant"))
        pieces.append(("" if m["role"] == "assistant" else "\n", False))
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("a conversation has no assistant turn: nothing to learn from it")
    return pieces if template is None else template.pieces(messages)


def _header(role: str) -> str:
    return f"<|{role}|>\n"


def encode_piece(tokenizer: Any, text: str) -> list[int]:
    """One piece's ids. No special tokens added per piece (a BOS before each): a
    template writes its own."""
    return tokenizer.encode(text, add_special_tokens=False).ids if text else []


def prompt_ids(messages: list[dict[str, Any]], tokenizer: Any, template: Any = None) -> list[int]:
    """The ids `sample --chat` feeds the model: the conversation so far and the assistant's
    header (the generation prompt), in pieces as training encoded them."""
    if template is not None:
        texts = [text for text, _ in template.pieces(messages, then_answer=True)]
    else:
        texts = [p for m in messages for p in (_header(m["role"]), m["content"], "\n")]
        texts.append(_header("assistant"))
    return [i for text in texts for i in encode_piece(tokenizer, text)]


def render(
    doc: Any, fmt: str, tokenizer: Any, eot: int, template: Any = None
) -> tuple[list[int], list[int]]:
    """(ids, mask) of one example, mask 1 where the token is a loss target; a chat by
    `template` (data/chat_template.py's ChatTemplate), or the default one."""
    if not isinstance(doc, dict):
        raise ValueError(f"a {fmt} example is a JSON object; got {type(doc).__name__}")
    if fmt == "prompt-completion":
        prompt = _string(doc, "prompt", "a prompt-completion example")
        completion = _string(doc, "completion", "a prompt-completion example")
        pieces = [(prompt, False), (completion, True)]
    else:
        pieces = _pieces_of_chat(doc, template)
    closed = fmt == "prompt-completion" or template is None  # an answer gets <|endoftext|>
    ids: list[int] = []
    mask: list[int] = []
    for text, target in pieces:
        encoded = encode_piece(tokenizer, text)
        ids += encoded
        mask += [int(target)] * len(encoded)
        if target and closed:  # an answer ends with <|endoftext|>, the model's stop token
            ids.append(eot)
            mask.append(1)
    if not any(mask):
        raise ValueError("the answer encodes to no token: nothing to learn from it")
    return ids, mask


def row_layout(packing: str, supervised: bool, cp: int = 1) -> str:
    """--packing resolved: `stream` (windows of the token stream), `documents` (whole
    documents packed into rows, each attending only to itself) or `none` (one document a
    row, padded). `auto`: documents for supervised data (its documents are its examples),
    or one a row under context parallelism, whose attention takes no document mask; the
    stream otherwise."""
    if packing != "auto":
        return packing
    if not supervised:
        return "stream"
    return "none" if cp > 1 else "documents"


def run_row_layout(cfg: Any, supervised: bool) -> str:
    """row_layout for a run's configuration."""
    return row_layout(cfg.data.packing, supervised, cfg.parallel.cp)


def masked_ids(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """int64 ids with each token outside the loss as ~id (paratrain/token_rows.py)."""
    out = ids.astype(np.int64)
    return np.where(mask.astype(bool), out, ~out)
