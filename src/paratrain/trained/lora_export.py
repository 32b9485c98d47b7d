"""A LoRA run's checkpoint out of paratrain: merged into the base (`--merge-lora`, for
`--format hf` and `safetensors`), or as a PEFT adapter (`--format peft`).

A LoRA run's checkpoint holds the frozen base and the adapters under the plain model's
names (`blocks.0.attn.q.weight`, `blocks.0.attn.q.lora_A.weight`: parallel/lora.py), and
its meta the rank, alpha and targets. Merging folds each adapter into its base weight,
W0 + (alpha / r) B A in float64, rounded once to the checkpoint's dtype (float32).

A PEFT adapter directory holds what `peft.PeftModel.from_pretrained(base, DIR)` reads
onto the transformers model of the base (the one imported with `paratrain import-hf`):
`adapter_model.safetensors`, the adapters under PEFT's names
(`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`, A (r, in) and B
(out, r) as nn.Linear keeps them, our layout too) and `adapter_config.json` (a LoraConfig:
r, lora_alpha, the adapted modules by their full Hugging Face names, no dropout, no bias).
Llama only: GPT-2's q, k and v are one fused Conv1D in transformers, which three adapters
of rank r would make one of rank 3r, not what `r` in a LoraConfig says.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from paratrain.models import hf
from paratrain.parallel.lora import merge_lora_weights

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."  # PeftModel's prefix before the transformers model's names


def lora_settings(meta: dict[str, Any]) -> tuple[int, float, str] | None:
    """(rank, alpha, targets) of the run whose checkpoint meta this is; None: no LoRA."""
    t = meta.get("train", {})
    if not t.get("lora_rank"):
        return None
    return int(t["lora_rank"]), float(t["lora_alpha"]), str(t.get("lora_targets", ""))


def exported_weights(
    tensors: dict[str, torch.Tensor], meta: dict[str, Any], merge: bool, fmt: str, run: Path
) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors as `--format fmt` writes them: merged with --merge-lora;
    a LoRA run's adapters kept apart only where the format can hold them (safetensors)."""
    lora = lora_settings(meta)
    if merge and lora is None:
        raise ValueError(f"--merge-lora: {run} was not trained with LoRA (no --lora-rank)")
    if lora is None:
        return tensors
    rank, alpha, _ = lora
    if merge:
        return merge_lora_weights(tensors, alpha / rank)
    if fmt == "hf":
        raise ValueError(
            f"--format hf: {run} is a LoRA run (rank {rank}); give --merge-lora for the merged "
            "model, or --format peft for the adapter"
        )
    return tensors


def export_peft(run_dir: Path, out: Path, tensors: dict[str, torch.Tensor], meta: dict) -> Path:
    """`--format peft`: `out` (new) with the adapter's weights and config."""
    lora = lora_settings(meta)
    if lora is None:
        raise ValueError(f"--format peft: {run_dir} was not trained with LoRA (no --lora-rank)")
    m = meta["model"]
    if m["arch"] != "llama":
        raise ValueError(
            f"--format peft: {run_dir} is a {m['arch']} model; PEFT adapters are written for "
            "Llama (GPT-2 fuses q, k and v); use --format hf --merge-lora"
        )
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out} already exists and is not empty; give a new directory")
    names = hf.hf_module_names(m["arch"], m["n_layer"])
    weights, modules = {}, []
    for key, t in tensors.items():
        if ".lora_" in key:
            layer, _, rest = key.partition(".lora_")  # rest: "A.weight" or "B.weight"
            weights[f"{PEFT_PREFIX}{names[layer]}.lora_{rest}"] = t.contiguous()
            if rest == "A.weight":
                modules.append(names[layer])
    rank, alpha, _ = lora
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
        "target_modules": sorted(modules), "lora_dropout": 0.0, "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "init_lora_weights": True,
        "inference_mode": True, "base_model_name_or_path": None,
    }  # fmt: skip
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_file(weights, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    if out.exists():
        out.rmdir()
    tmp.replace(out)  # complete or absent
    return out
