"""The run configuration from the command line: one flag per configuration field (its
help from the field's), a --config TOML file, --resume's run and --init-from's model, and
which fields the user gave (so a flag with no effect is refused: config.EFFECTS).
Used by `train` and by whatever else reads a run configuration from flags."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from paratrain.config import FieldEntry, RunConfig, every_field, flag_for
from paratrain.config.fields import range_words
from paratrain.config.toml_file import apply_overrides, load_toml
from paratrain.models.presets import CUSTOM, MODEL_PRESETS, preset

# Valid values the configuration cannot list itself (it imports nothing from paratrain),
# for the help only: the preset check is validate/rules_model.py's.
LISTED_HERE = {"model.name": (*MODEL_PRESETS, CUSTOM)}


def help_line(entry: FieldEntry) -> str:
    """The field's help, then its choices (or interval) and its default, each once:
    'Pipeline schedule. (choices: gpipe, 1f1b, interleaved, zb-h1; default: 1f1b)'."""
    facts = entry.facts
    notes = []
    choices = facts.choices or LISTED_HERE.get(entry.key)
    if choices:
        notes.append("choices: " + ", ".join(map(str, choices)))
    bounded = facts.at_most is not None or facts.below is not None
    if bounded:  # an interval; a lower bound alone (a count is at least 1) goes unsaid
        notes.append(str(range_words(facts)))
    if facts.default_means is not None:
        notes.append(f"default: {facts.default_means}")
    elif isinstance(entry.default, bool):
        notes.append("default: " + ("on" if entry.default else "off"))
    else:
        notes.append(f"default: {entry.default}")
    # argparse formats help with %: a literal one is doubled
    return f"{facts.help} ({'; '.join(notes)})".replace("%", "%%")


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    groups: dict[str, Any] = {}
    for entry in every_field():
        if entry.section not in groups:
            groups[entry.section] = parser.add_argument_group(f"[{entry.section}]")
        group, kind = groups[entry.section], entry.kind
        dest, help_text = entry.key, help_line(entry)
        if kind is bool:  # --flag / --no-flag
            on_off = argparse.BooleanOptionalAction
            group.add_argument(entry.flag, dest=dest, default=None, action=on_off, help=help_text)
            continue
        metavar = kind.__name__.upper()
        action = JoinRepeated if entry.facts.repeatable else "store"
        group.add_argument(
            entry.flag,
            dest=dest,
            type=kind,
            default=None,
            metavar=metavar,
            help=help_text,
            action=action,
        )


class JoinRepeated(argparse.Action):
    """A repeatable flag of a comma-separated list: `--f a --f b,c` gives 'a,b,c'."""

    def __call__(
        self, parser: Any, namespace: argparse.Namespace, values: Any, option: Any = None
    ) -> None:
        before = getattr(namespace, self.dest)
        setattr(namespace, self.dest, values if before is None else f"{before},{values}")


def config_from_args(args: argparse.Namespace) -> RunConfig:
    cfg = RunConfig()
    resume = getattr(args, "train.resume", None)
    if resume:  # the run's own config first; the layout may change, so dp and K are redone
        base = Path(resume) / "config.toml"
        if not base.is_file():
            raise ValueError(f"--resume {resume!r}: no {base}; give a paratrain run directory")
        apply_overrides(cfg, load_toml(str(base)), f"run directory {resume}")
        cfg.parallel.dp, cfg.train.microbatches = 0, 0
        out = getattr(args, "train.out", None)
        if out and Path(out).resolve() != Path(resume).resolve():
            raise ValueError(
                f"--out {out!r} with --resume {resume!r}: a resumed run stays in its directory"
            )
        cfg.train.out = resume
    from_file = load_toml(args.config) if args.config else {}
    overrides: dict[str, dict[str, Any]] = {}
    for key, value in vars(args).items():
        if "." in key and value is not None:
            section, name = key.split(".", 1)
            overrides.setdefault(section, {})[name] = value
    # The model preset first: its shape is the default that the file and the flags change;
    # with --init-from, the source run's model is.
    name = overrides.get("model", {}).get("name") or from_file.get("model", {}).get("name")
    if name and not resume:
        apply_overrides(cfg, {"model": {**preset(name), "name": name}}, f"model preset {name}")
    source = overrides.get("train", {}).get("init_from") or from_file.get("train", {}).get(
        "init_from"
    )
    if source and not resume:
        base = Path(source) / "config.toml"
        if not base.is_file():
            raise ValueError(f"--init-from {source!r}: no {base}; give a paratrain run directory")
        model = load_toml(str(base)).get("model", {})
        apply_overrides(cfg, {"model": model}, f"--init-from {source}")
    if args.config:
        apply_overrides(cfg, from_file, f"config file {args.config}")
    apply_overrides(cfg, overrides, "command line")
    if "vocab_size" not in {**from_file.get("model", {}), **overrides.get("model", {})}:
        _vocabulary_for_the_data(cfg)
    return cfg


def explicit_fields(args: argparse.Namespace) -> dict[str, str]:
    """'section.name' -> how the user gave it: a flag, or a key of --config's file (a
    resumed run's own config.toml is not the user's choice now, so it is not listed)."""
    given: dict[str, str] = {}
    if args.config:
        for section, entries in load_toml(args.config).items():
            for name in entries if isinstance(entries, dict) else ():
                given[f"{section}.{name}"] = f"in {args.config}"
    for key, value in vars(args).items():
        if "." in key and value is not None:
            given[key] = flag_for(*key.split(".", 1))
    return given


def _vocabulary_for_the_data(cfg: RunConfig) -> None:
    """With a tokenizer (--tokenizer or a prepared directory's), a vocabulary that covers it,
    padded for tensor parallelism, unless one was given (then checked against the data)."""
    from paratrain.data.checks import tokenizer_vocab
    from paratrain.data.tokenizer import padded_vocab

    vocab = tokenizer_vocab(cfg)
    if vocab is not None and cfg.model.vocab_size < vocab:
        cfg.model.vocab_size = padded_vocab(vocab)
