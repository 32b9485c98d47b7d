""" "Did you mean" for a refusal: a misspelled flag, command, choice or preset.

Works on what the user sees: argparse's messages (unrecognized arguments, invalid choice)
and the refusals' own "FLAG 'VALUE'; valid: a, b, c" form, so that no check has to know.
"""

from __future__ import annotations

import argparse
import difflib
import re

# "--model 'gpt-tinyy'; valid: gpt-tiny, ..." and "preset '8b' unknown ...; valid: ..."
_VALID = re.compile(r"'(?P<value>[^']+)'[^;]*;.*?valid: (?P<valid>[^;()]+)")
# argparse: "invalid choice: 'trian' (choose from 'train', 'plan', ...)"
_CHOICE = re.compile(r"invalid choice: '(?P<value>[^']+)' \(choose from (?P<valid>[^)]+)\)")


def closest(word: str, candidates: list[str]) -> str | None:
    """The one candidate the word abbreviates, else the nearest if near enough to be a typo
    of it (3 of 4 characters right: `1f1c` for `1f1b`; `llama-9000` is no `llama3-70b`)."""
    longer = [c for c in candidates if c.startswith(word)]
    if len(longer) == 1:
        return longer[0]
    found = difflib.get_close_matches(word, candidates, n=1, cutoff=0.75)
    return found[0] if found else None


def hint(message: str) -> str:
    """ " (did you mean 'x'?)" for a refusal naming a value and its valid ones, else ""."""
    for pattern in (_CHOICE, _VALID):
        m = pattern.search(message)
        if m:
            valid = [v.strip(" '\"") for v in m["valid"].split(",")]
            near = closest(m["value"], [v for v in valid if v])
            return f" (did you mean {near!r}?)" if near and near != m["value"] else ""
    return ""


def unknown_flags_message(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """argparse's "unrecognized arguments" line, each misspelled flag's nearest flag after."""
    flags = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
    near: list[str] = []
    for extra in extras:
        flag = extra.split("=", 1)[0]
        if flag.startswith("--"):
            near += nearest_flags(flag, flags)
    said = f"unrecognized arguments: {' '.join(extras)}"
    return said + (f" (did you mean {' or '.join(near)}?)" if near else "")


def nearest_flags(flag: str, flags: list[str]) -> list[str]:
    """The flags a prefix abbreviates (what argparse used to accept silently, up to three),
    else the one nearest by spelling."""
    longer = [f for f in flags if f.startswith(flag)]
    if 0 < len(longer) <= 3:
        return longer
    match = closest(flag, flags)
    return [match] if match else []
