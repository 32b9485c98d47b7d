"""What a --data path holds, answered without torch (the CLI checks data before any
worker starts, and a refusal must not wait for torch to load): the held-out split by
file, the tokenizer a run's ids need, and whether "text" is really binary.
"""

from __future__ import annotations

import codecs
import hashlib
from pathlib import Path
from typing import Any

from paratrain.data.prepared import TOKENIZER_COPY, is_prepared

SNIFF_BYTES = 1 << 16  # what is read of a text file to tell text from binary
MAX_INVALID_UTF8 = 0.01  # a little Latin-1 in a UTF-8 text is tolerated; binary is not


def is_val_file(relative: str, val_fraction: float) -> bool:
    # Hash of the path, not its position, so that the split of a file never changes when
    # other files are added or removed.
    digest = hashlib.sha256(relative.encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < val_fraction


def data_tokenizer(cfg: Any) -> Path | None:
    """The tokenizer.json a run's data is encoded with: --tokenizer's, or a prepared
    directory's own copy; None for bytes and .bin ids."""
    if is_prepared(cfg.data.path):
        return Path(cfg.data.path) / TOKENIZER_COPY
    return Path(cfg.data.tokenizer) if cfg.data.tokenizer else None


def binary_reason(head: bytes) -> str | None:
    """Why these first bytes of a file given as text are not text (NUL bytes, or more than
    MAX_INVALID_UTF8 of them not UTF-8), or None for text."""
    if b"\0" in head:
        return f"has NUL bytes (the first at byte {head.index(0)})"
    # final=False: a multi-byte character cut at the end of the sniffed head is no error
    text = codecs.getincrementaldecoder("utf-8")(errors="replace").decode(head, final=False)
    bad = text.count("\ufffd")
    if head and bad / len(head) > MAX_INVALID_UTF8:
        return f"is {bad / len(head):.0%} invalid UTF-8 in its first {len(head):,} bytes"
    return None


def check_is_text(path: Path) -> None:
    """Refuse a binary file given as text, saying how to pass token ids instead."""
    with path.open("rb") as f:
        why = binary_reason(f.read(SNIFF_BYTES))
    if why is not None:
        raise ValueError(
            f"--data {str(path)!r} {why}: it is not text. Give token ids as a .bin of "
            "uint16 (numpy: ids.astype('uint16').tofile('data.bin')), or text files"
        )
