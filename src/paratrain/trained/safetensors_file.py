"""A checkpoint's model as one safetensors file, and that file back as a plain GPT.

The sharded checkpoint already stores every parameter under the single-process model's
name with its global shape, so consolidating is one DCP load in this process (no process
group), into full-size tensors allocated from the checkpoint's index. Only the model is
exported (fp32; the master copy under mixed precision: parameters and persistent buffers,
the router's balancing bias), not the optimizer.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from paratrain import checkpoint
from paratrain.checkpoint.whole_model import load_weights, read_model
from paratrain.config import ModelConfig, RunConfig
from paratrain.train.build import build_model
from paratrain.trained.lora_export import exported_weights, lora_settings

EXPORT_FILE = "model.safetensors"
META_KEY = "paratrain"


def pick_checkpoint(run_dir: Path, step: int | None) -> checkpoint.Checkpoint:
    done = checkpoint.complete_checkpoints(run_dir)
    if not done:
        raise ValueError(f"{run_dir} has no complete checkpoint (in {checkpoint.CHECKPOINTS}/)")
    if step is None:
        return done[-1]
    for ckpt in done:
        if ckpt.step == step:
            return ckpt
    steps = ", ".join(str(c.step) for c in done)
    raise ValueError(f"--step {step}: no complete checkpoint of that step; have {steps}")


def export_safetensors(
    run_dir: Path, out: Path | None = None, step: int | None = None, merge_lora: bool = False
) -> Path:
    """Write the model of `run_dir`'s latest (or `step`'s) checkpoint; return the file. A
    LoRA run's adapters are folded into the base with merge_lora, else kept beside it
    (the header then says so, and `load_exported` builds the adapted model)."""
    ckpt = pick_checkpoint(run_dir, step)
    out = out or run_dir / EXPORT_FILE
    if out.exists():
        raise ValueError(f"--out {out} already exists; give a new file name")
    meta = checkpoint.read_meta(ckpt.path)
    weights = exported_weights(read_model(ckpt.path), meta, merge_lora, "safetensors", run_dir)
    tensors = {name: t.contiguous() for name, t in weights.items()}
    lora = lora_settings(meta) if not merge_lora else None
    adapters = (
        dict(zip(("lora_rank", "lora_alpha", "lora_targets"), lora, strict=True)) if lora else {}
    )
    header = {META_KEY: json.dumps({"model": meta["model"], "step": meta["step"], **adapters})}
    tmp = out.with_name(out.name + ".tmp")
    save_file(tensors, str(tmp), metadata=header)
    tmp.replace(out)  # complete or absent
    return out


def load_exported(path: Path) -> nn.Module:
    """A single-process model with the exported weights (every parameter, no unknown
    name; buffers an older export lacks keep their initial values)."""
    with safe_open(str(path), framework="pt") as f:
        header = json.loads((f.metadata() or {}).get(META_KEY, "null") or "null")
    if not header:
        raise ValueError(f"{path} was not written by `paratrain export` (no {META_KEY} header)")
    cfg = RunConfig(model=ModelConfig(**header["model"]))
    for key in ("lora_rank", "lora_alpha", "lora_targets"):  # an unmerged LoRA run's
        if key in header:
            setattr(cfg.train, key, header[key])
    model = build_model(cfg)
    load_weights(model, load_file(str(path)), str(path))
    return model
