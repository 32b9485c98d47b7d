"""A tokenizer's own chat template (`prepare --format chat --chat-template`): the Jinja
template that Hugging Face keeps in `tokenizer_config.json` beside `tokenizer.json`,
rendered as transformers renders it (a sandboxed Jinja environment, `messages`,
`add_generation_prompt`, the special tokens), and cut into pieces for the loss mask.

The mask comes from prefixes: a conversation's text up to message i with the generation
prompt (the assistant's header) is no target, and what message i, an assistant's, adds
after it (its content and the template's end of turn) is. A template that does not
render a conversation's prefixes as prefixes of the whole cannot be cut so and is
refused in one line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CHOICES = ("auto", "default", "tokenizer")
SETTINGS = "tokenizer_config.json"
# What a chat data set was rendered with, kept beside its tokenizer (a prepared directory,
# a run's tokenizer/): {"template": None} for the default template, else template_source's.
KEPT = "chat_template.json"


def _token(value: Any) -> str:
    """A tokenizer_config.json special token: a string or {"content": ...}."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


def template_source(tokenizer_file: Path, choice: str) -> dict[str, Any] | None:
    """The template and special tokens to render with, or None for the default template:
    `auto` takes the tokenizer's when its tokenizer_config.json has one."""
    if choice not in CHOICES:
        raise ValueError(f"--chat-template {choice!r}; valid: {', '.join(CHOICES)}")
    if choice == "default":
        return None
    settings_file = tokenizer_file.parent / SETTINGS
    settings = json.loads(settings_file.read_text()) if settings_file.is_file() else {}
    template = settings.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str):
        if choice == "tokenizer":
            raise ValueError(
                f"--chat-template tokenizer: {str(settings_file)!r} has no chat_template; "
                "use --chat-template default (or auto)"
            )
        return None
    tokens = {k: _token(settings.get(k)) for k in ("bos_token", "eos_token")}
    return {"template": template, **tokens}


class ChatTemplate:
    """A compiled template: `pieces(messages)` -> (text, is a target) pieces."""

    def __init__(self, source: dict[str, Any]) -> None:
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise ValueError(f"the chat template refused the conversation: {message}")

        # The environment transformers renders in: blocks trimmed, loop controls, tojson.
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent)
        env.globals["raise_exception"] = raise_exception
        self.template = env.from_string(source["template"])
        self.tokens = {k: v for k, v in source.items() if k != "template"}

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return self.template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **self.tokens
        )

    def pieces(
        self, messages: list[dict[str, Any]], then_answer: bool = False
    ) -> list[tuple[str, bool]]:
        """The conversation's pieces; `then_answer`: and the generation prompt after it
        (what `sample --chat` feeds the model), cut as training cut it."""
        done, pieces = "", []
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                prompt = self.render(messages[:i], True)
                pieces.append((self._after(done, prompt), False))
                done = prompt
            text = self.render(messages[: i + 1], False)
            pieces.append((self._after(done, text), m["role"] == "assistant"))
            done = text
        if then_answer:
            pieces.append((self._after(done, self.render(messages, True)), False))
        return pieces

    @staticmethod
    def _after(done: str, text: str) -> str:
        if not text.startswith(done):
            raise ValueError(
                "the tokenizer's chat template does not render this conversation's "
                "prefixes as prefixes of it, so its answers cannot be masked; "
                "use --chat-template default"
            )
        return text[len(done) :]


def kept_template(tokenizer_dir: Path) -> dict[str, Any] | None:
    """The template a run's chats were rendered with: KEPT's where a chat data set left
    it, else the tokenizer's own (an imported model's tokenizer_config.json); None: the
    default template."""
    kept = tokenizer_dir / KEPT
    if kept.is_file():
        source: dict[str, Any] = json.loads(kept.read_text())
        return source if source.get("template") else None
    return template_source(tokenizer_dir / "tokenizer.json", "auto")
