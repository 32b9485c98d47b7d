"""Supervised examples (`paratrain prepare --format chat|prompt-completion`): one JSON
line each, rendered into token ids and a loss mask that covers only what the model is to
learn to answer.

- chat: `{"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}`,
  rendered with the default template (TEMPLATE_DOC): each message is a header line naming
  its role, then its content; a system or user message ends with a newline, an assistant
  message with `<|endoftext|>`. Only the assistant's content and its `<|endoftext|>` are
  loss targets.
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


def _pieces_of_chat(doc: dict[str, Any]) -> list[tuple[str, bool]]:
    """(text, is a target) pieces of one conversation, without the closing tokens."""
    messages = doc.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("a chat example needs a non-empty list 'messages'")
    pieces: list[tuple[str, bool]] = []
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ValueError(f"a message needs a 'role' of {', '.join(ROLES)}; got {m!r:.60}")
        content = _string(m, "content", "a message")
        pieces.append((f"<|{m['role']}|>\n", False))
        pieces.append((content, m["role"] == "assistant"))
        pieces.append(("" if m["role"] == "assistant" else "\n", False))
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("a conversation has no assistant turn: nothing to learn from it")
    return pieces


def render(doc: Any, fmt: str, tokenizer: Any, eot: int) -> tuple[list[int], list[int]]:
    """(ids, mask) of one example, mask 1 where the token is a loss target."""
    if not isinstance(doc, dict):
        raise ValueError(f"a {fmt} example is a JSON object; got {type(doc).__name__}")
    if fmt == "prompt-completion":
        prompt = _string(doc, "prompt", "a prompt-completion example")
        completion = _string(doc, "completion", "a prompt-completion example")
        pieces = [(prompt, False), (completion, True)]
    else:
        pieces = _pieces_of_chat(doc)
    ids: list[int] = []
    mask: list[int] = []
    for text, target in pieces:
        encoded = tokenizer.encode(text).ids if text else []
        ids += encoded
        mask += [int(target)] * len(encoded)
        if target:  # an answer ends with <|endoftext|>, the model's stop token
            ids.append(eot)
            mask.append(1)
    if not any(mask):
        raise ValueError("the answer encodes to no token: nothing to learn from it")
    return ids, mask


def one_example_a_row(packing: str, supervised: bool) -> bool:
    """--packing's rows: one document each for `none`, and for `auto` on supervised data
    (its documents are its examples); windows of the stream otherwise."""
    return packing == "none" or (packing == "auto" and supervised)


def masked_ids(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """int64 ids with each token outside the loss as ~id (paratrain/token_rows.py)."""
    out = ids.astype(np.int64)
    return np.where(mask.astype(bool), out, ~out)
