"""What an exported Hugging Face directory carries beside its weights, so that a user can
feed it: the special ids in config.json, the tokenizer's files, and a README (model card)
saying what the ids are.

Three kinds of run:
- with a tokenizer (`tokenizer train`'s byte-level BPE, or an import's): its files go
  along; the special ids are its tokenizer_config.json's tokens when it has one, else
  `<|endoftext|>` as bos, eos and pad (GPT-2's convention, pad added).
- byte-level (no tokenizer, the default data): every id 0-255 is one byte of UTF-8 text,
  and documents are concatenated without a separator, so there is no bos or eos (null:
  GPT-2's config would otherwise default to 50256, outside the vocabulary); pad is 0, the
  NUL byte, which training text never holds (data/files.py refuses it). A tokenizer.json
  that maps each byte to its own id is written, so AutoTokenizer works too.
- token ids of an unknown tokenizer (.bin data, an import without its tokenizer's files):
  the special ids are null and the README says to use the data's own tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from paratrain.data.tokenizer import EOT

SPECIAL = ("bos", "eos", "pad")
BYTE_PAD_ID = 0
BYTES = 256


def ids_kind(run_dir: Path, meta: dict[str, Any], vocab_size: int) -> str:
    """What the model's ids are: "tokenizer" (the run has one), "bytes" (trained on text
    as bytes, or an import of 256 ids without a tokenizer), or "unknown" (.bin ids, or an
    import whose tokenizer did not come along)."""
    if (run_dir / "tokenizer" / "tokenizer.json").is_file():
        return "tokenizer"
    if "imported_from" in meta:
        return "bytes" if vocab_size == BYTES else "unknown"
    from paratrain.config.toml_file import from_toml_text

    config = run_dir / "config.toml"
    data = from_toml_text(config.read_text()).data.path if config.is_file() else ""
    return "unknown" if data.endswith(".bin") else "bytes"


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (tokenizers' ByteLevel uses the same)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_tokenizer_json() -> str:
    """A tokenizer.json whose ids are the bytes themselves: "hi" -> [104, 105]."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: b for b, char in byte_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer.to_str()


def _token_name(value: Any) -> str | None:
    """A tokenizer_config.json special token: a string or {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


def special_ids(tokenizer_dir: Path, kind: str) -> dict[str, int | None]:
    """config.json's bos_token_id, eos_token_id and pad_token_id for the run's ids (null
    where unknown, so that GPT2Config's 50256 is not assumed)."""
    file = tokenizer_dir / "tokenizer.json"
    if kind != "tokenizer":
        pad = BYTE_PAD_ID if kind == "bytes" else None
        return {"bos_token_id": None, "eos_token_id": None, "pad_token_id": pad}
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(file))
    settings = tokenizer_dir / "tokenizer_config.json"
    named = json.loads(settings.read_text()) if settings.is_file() else {}
    ids = {}
    for kind in SPECIAL:
        name = _token_name(named.get(f"{kind}_token")) or (EOT if not named else None)
        ids[f"{kind}_token_id"] = None if name is None else tokenizer.token_to_id(name)
    return ids


def tokenizer_files(tokenizer_dir: Path, max_seq_len: int, kind: str) -> dict[str, str]:
    """The files to write beside the weights that the run's tokenizer directory lacks."""
    files: dict[str, str] = {}
    settings: dict[str, Any]
    if kind == "unknown":
        return files
    if kind == "bytes":
        files["tokenizer.json"] = byte_tokenizer_json()
        settings = {"pad_token": byte_to_unicode()[BYTE_PAD_ID]}
    else:
        settings = {f"{kind}_token": EOT for kind in SPECIAL}
    if not (tokenizer_dir / "tokenizer_config.json").is_file():
        settings |= {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_seq_len}
        files["tokenizer_config.json"] = json.dumps(settings, indent=2) + "\n"
    return files


UNKNOWN_IDS = (
    "No tokenizer came with this run (token ids given as a .bin, or an import without "
    "its tokenizer's files): feed the ids of the tokenizer the data was made with."
)


def model_card(
    name: str, arch: str, m: Any, step: int, ids: dict[str, int | None], kind: str
) -> str:
    """README.md: what the model is and how to feed it (kind: ids_kind's answer)."""
    byte_level = kind == "bytes"
    if kind == "unknown":
        return _card_head(name, arch, m, step) + UNKNOWN_IDS + "\n"
    feed = (
        "Byte-level: the model reads raw UTF-8 bytes, token id = byte value (0-255), with "
        "no bos or eos token (documents were concatenated). Give ids as\n"
        "`list(text.encode())` and decode with `bytes(ids).decode(errors='replace')`;\n"
        "`tokenizer.json` here does the same mapping. pad is 0 (NUL, never in the text)."
        if byte_level
        else "Use the tokenizer in this directory (`AutoTokenizer.from_pretrained`); "
        f"special ids: bos {ids['bos_token_id']}, eos {ids['eos_token_id']}, "
        f"pad {ids['pad_token_id']}."
    )
    encode = "torch.tensor([list(prompt.encode())])" if byte_level else "tok(prompt).input_ids"
    decode = (
        "bytes(out[0].tolist()).decode(errors='replace')" if byte_level else "tok.decode(out[0])"
    )
    load_tok = "" if byte_level else 'tok = transformers.AutoTokenizer.from_pretrained("DIR")\n'
    return f"""{_card_head(name, arch, m, step)}{feed}

```python
import torch, transformers
model = transformers.AutoModelForCausalLM.from_pretrained("DIR")  # DIR: this directory
{load_tok}prompt = "def "
ids = {encode if byte_level else "torch.tensor([" + encode + "])"}
out = model.generate(ids, max_new_tokens=40, do_sample=False, pad_token_id={ids["pad_token_id"]})
print({decode})
```
"""


def _card_head(name: str, arch: str, m: Any, step: int) -> str:
    layers = f"{m.n_layer} layer" + ("" if m.n_layer == 1 else "s")
    return f"""---
library_name: transformers
tags: [paratrain]
---
# {name}

Exported by `paratrain export --format hf` from step {step}: {arch}, {layers},
d_model {m.d_model}, {m.n_head} heads, vocabulary {m.vocab_size}, context {m.max_seq_len}.

## How to feed it

"""
