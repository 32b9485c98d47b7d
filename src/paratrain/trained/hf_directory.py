"""Hugging Face directories in and out: `paratrain import-hf` and `export --format hf`.

A `save_pretrained` directory is `config.json` and the weights in safetensors, one file
(`model.safetensors`) or several with an index (`model.safetensors.index.json`), plus the
tokenizer's files when it has one. The conversion of names and configs is models/hf.py's;
this module reads and writes the files and our run directories:

- import: the Hugging Face model -> our plain model (every weight placed, shapes checked)
  -> a new run directory with `config.toml` and a step-0 checkpoint (model only), which
  `paratrain train --init-from RUN_DIR` starts from on any mesh, and `export` and `eval`
  read like any run's; the tokenizer's files are copied into RUN_DIR/tokenizer/.
- export: a run's latest checkpoint -> a directory that
  `transformers.AutoModelForCausalLM.from_pretrained` loads, with the tokenizer's files
  (a byte-level one written for a byte-level run), the special ids in config.json and a
  README saying how to feed it (hf_card.py).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from paratrain import checkpoint
from paratrain.checkpoint.whole_model import load_weights, read_model, write_model
from paratrain.config import RunConfig
from paratrain.models import hf
from paratrain.train import run_dir as rd
from paratrain.train.build import build_model
from paratrain.trained.hf_card import ids_kind, model_card, special_ids, tokenizer_files
from paratrain.trained.lora_export import exported_weights
from paratrain.trained.safetensors_file import pick_checkpoint

CONFIG = "config.json"
CARD = "README.md"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER_DIR = "tokenizer"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


def read_hf_dir(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """config.json and every weight of a Hugging Face model directory."""
    if not (path / CONFIG).is_file():
        raise ValueError(f"{path}: no {CONFIG}; give a directory written by save_pretrained")
    config = json.loads((path / CONFIG).read_text())
    if (path / INDEX).is_file():
        shards = sorted(set(json.loads((path / INDEX).read_text())["weight_map"].values()))
    elif (path / WEIGHTS).is_file():
        shards = [WEIGHTS]
    else:
        raise ValueError(f"{path}: no {WEIGHTS} nor {INDEX} (only safetensors weights are read)")
    weights: dict[str, torch.Tensor] = {}
    for shard in shards:
        weights.update(load_file(str(path / shard), device="cpu"))
    return config, weights


def import_hf(hf_dir: Path, out: str) -> Path:
    """A new run directory holding the Hugging Face model as our model's step-0 checkpoint."""
    config, weights = read_hf_dir(hf_dir)
    fields = hf.from_hf_config(config)  # refuses what we cannot represent, before writing
    cfg = RunConfig()
    cfg.model = dataclasses.replace(cfg.model, **fields, name="custom")
    model = build_model(cfg)  # its names and shapes: every weight must find its place
    m = cfg.model
    ours = hf.to_ours(m.arch, m.n_layer, m.tie_embeddings, weights)
    load_weights(model.float(), {k: v.float() for k, v in ours.items()}, str(hf_dir))
    run_dir = rd.prepare_run_dir(out)
    cfg.train.out = str(run_dir)
    rd.write_config(run_dir, cfg)
    meta = {
        "step": 0,
        "adam_step": 0,
        "layout": {"world_size": 1, "dp": 1, "pp": 1, "tp": 1, "zero": 0},
        "chunks": 1,
        "model": dataclasses.asdict(cfg.model),
        "train": {},
        "data_fingerprint_sha256": "",
        "imported_from": str(hf_dir.resolve()),
        "saved": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    write_model(checkpoint.checkpoint_path(run_dir, 0), model, meta)
    tokenizer = [f for f in TOKENIZER_FILES if (hf_dir / f).is_file()]
    if tokenizer:
        (run_dir / TOKENIZER_DIR).mkdir()
        for name in tokenizer:
            shutil.copy2(hf_dir / name, run_dir / TOKENIZER_DIR / name)
    return run_dir


def export_hf(run_dir: Path, out: Path, step: int | None = None, merge_lora: bool = False) -> Path:
    """A Hugging Face directory (config.json, model.safetensors, the run's tokenizer if it
    has one) of `run_dir`'s latest (or `step`'s) checkpoint; a LoRA run's with merge_lora
    (its adapters folded into the base: trained/lora_export.py)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out} already exists and is not empty; give a new directory")
    ckpt = pick_checkpoint(run_dir, step)
    cfg = RunConfig()
    meta = checkpoint.read_meta(ckpt.path)
    cfg.model = dataclasses.replace(cfg.model, **meta["model"])
    m = cfg.model
    if m.num_experts:
        raise ValueError(
            f"--format hf: {run_dir} is a mixture of experts ({m.num_experts} experts), which "
            "GPT2LMHeadModel and LlamaForCausalLM cannot hold; use --format safetensors"
        )
    if m.arch == "llama":  # config.json names the resolved width and key/value heads
        from paratrain.models.presets import ffn_width, kv_heads

        m = dataclasses.replace(m, ffn_hidden=ffn_width(m), n_kv_head=kv_heads(m))
    ours = exported_weights(read_model(ckpt.path), meta, merge_lora, "hf", run_dir)
    weights = hf.to_hf(m.arch, m.n_layer, m.tie_embeddings, ours)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    tokenizer = run_dir / TOKENIZER_DIR
    kind = ids_kind(run_dir, meta, m.vocab_size)
    ids = special_ids(tokenizer, kind)  # config.json says how documents start, end and pad
    (tmp / CONFIG).write_text(json.dumps(hf.to_hf_config(m) | ids, indent=2) + "\n")
    save_file(weights, str(tmp / WEIGHTS), metadata={"format": "pt"})
    if tokenizer.is_dir():
        for f in tokenizer.iterdir():
            shutil.copy2(f, tmp / f.name)
    for name, text in tokenizer_files(tokenizer, m.max_seq_len, kind).items():
        (tmp / name).write_text(text)
    (tmp / CARD).write_text(model_card(run_dir.name, m.arch, m, ckpt.step, ids, kind))
    if out.exists():
        out.rmdir()
    tmp.replace(out)  # complete or absent
    return out
