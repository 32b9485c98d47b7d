"""Hugging Face's GPT2LMHeadModel and LlamaForCausalLM against our GPT and Llama: configs
and parameter names, both ways. Pure conversion of dicts and tensors; the files are
trained/hf_directory.py's.

GPT-2 keeps its attention and MLP weights in `Conv1D` layers, (in, out) where nn.Linear
has (out, in), so they are transposed, and its q, k and v in one `c_attn` of 3d outputs,
split here into our three. Llama's names map one to one (ours drop `_proj`). A tied head
is not in a Hugging Face file (`save_pretrained` leaves it out): it is the token table.

A config field we cannot represent is refused in one line naming it, never dropped.
"""

from __future__ import annotations

from typing import Any

import torch

HF_ARCHS = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}  # model_type -> class
OUR_ARCH = {"gpt2": "gpt", "llama": "llama"}

# (Hugging Face name, ours, transposed); {i} is the block. GPT-2's fused c_attn apart.
GPT2_NAMES = [
    ("transformer.wte.weight", "tok_emb.weight", False),
    ("transformer.wpe.weight", "pos_emb.weight", False),
    ("transformer.h.{i}.ln_1.weight", "blocks.{i}.ln1.weight", False),
    ("transformer.h.{i}.ln_1.bias", "blocks.{i}.ln1.bias", False),
    ("transformer.h.{i}.attn.c_proj.weight", "blocks.{i}.attn.proj.weight", True),
    ("transformer.h.{i}.attn.c_proj.bias", "blocks.{i}.attn.proj.bias", False),
    ("transformer.h.{i}.ln_2.weight", "blocks.{i}.ln2.weight", False),
    ("transformer.h.{i}.ln_2.bias", "blocks.{i}.ln2.bias", False),
    ("transformer.h.{i}.mlp.c_fc.weight", "blocks.{i}.mlp.fc.weight", True),
    ("transformer.h.{i}.mlp.c_fc.bias", "blocks.{i}.mlp.fc.bias", False),
    ("transformer.h.{i}.mlp.c_proj.weight", "blocks.{i}.mlp.proj.weight", True),
    ("transformer.h.{i}.mlp.c_proj.bias", "blocks.{i}.mlp.proj.bias", False),
    ("transformer.ln_f.weight", "norm.weight", False),
    ("transformer.ln_f.bias", "norm.bias", False),
    ("lm_head.weight", "head.weight", False),
]
GPT2_QKV = ("transformer.h.{i}.attn.c_attn", ("q", "k", "v"))  # one (d, 3d) Conv1D
LLAMA_NAMES = [
    ("model.embed_tokens.weight", "tok_emb.weight", False),
    ("model.layers.{i}.input_layernorm.weight", "blocks.{i}.attn_norm.weight", False),
    *[
        (f"model.layers.{{i}}.self_attn.{x}_proj.weight", f"blocks.{{i}}.attn.{x}.weight", False)
        for x in ("q", "k", "v", "o")
    ],
    ("model.layers.{i}.post_attention_layernorm.weight", "blocks.{i}.mlp_norm.weight", False),
    *[
        (f"model.layers.{{i}}.mlp.{x}_proj.weight", f"blocks.{{i}}.mlp.{x}.weight", False)
        for x in ("gate", "up", "down")
    ],
    ("model.norm.weight", "norm.weight", False),
    ("lm_head.weight", "head.weight", False),
]
NAMES = {"gpt": GPT2_NAMES, "llama": LLAMA_NAMES}


def _refuse(field: str, value: Any, why: str) -> ValueError:
    return ValueError(f"Hugging Face config {field} = {value!r}: {why}")


def from_hf_config(c: dict[str, Any]) -> dict[str, Any]:
    """[model] fields of our model for a Hugging Face config.json; ValueError naming the
    first field we cannot represent."""
    kind = c.get("model_type")
    if kind not in HF_ARCHS:
        raise _refuse("model_type", kind, f"valid: {', '.join(HF_ARCHS)}")
    return _gpt2_fields(c) if kind == "gpt2" else _llama_fields(c)


def _gpt2_fields(c: dict[str, Any]) -> dict[str, Any]:
    d = c["n_embd"]
    gelus = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
    act = c.get("activation_function", "gelu_new")
    if act not in gelus:
        raise _refuse("activation_function", act, f"valid: {', '.join(gelus)}")
    if c.get("n_inner") not in (None, 4 * d):
        raise _refuse("n_inner", c["n_inner"], f"our GPT's MLP is 4 * n_embd = {4 * d}")
    if c.get("layer_norm_epsilon", 1e-5) != 1e-5:
        raise _refuse("layer_norm_epsilon", c["layer_norm_epsilon"], "ours is 1e-5")
    for flag, ours in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False)):
        if c.get(flag, ours) != ours:
            raise _refuse(flag, c[flag], f"ours is {ours}")
    drops = {k: c.get(k, 0.1) for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")}
    if len(set(drops.values())) > 1:
        raise _refuse("attn_pdrop", drops["attn_pdrop"], f"ours is one dropout for all: {drops}")
    return {
        "arch": "gpt",
        "vocab_size": c["vocab_size"],
        "n_layer": c["n_layer"],
        "n_head": c["n_head"],
        "d_model": d,
        "max_seq_len": c["n_positions"],
        "tie_embeddings": c.get("tie_word_embeddings", True),
        "activation": gelus[act],
        "dropout": drops["resid_pdrop"],
    }


def _llama_fields(c: dict[str, Any]) -> dict[str, Any]:
    d, heads = c["hidden_size"], c["num_attention_heads"]
    if c.get("hidden_act", "silu") != "silu":
        raise _refuse("hidden_act", c["hidden_act"], "our SwiGLU uses silu")
    for flag in ("attention_bias", "mlp_bias"):
        if c.get(flag):
            raise _refuse(flag, c[flag], "our Llama has no biases")
    if c.get("head_dim") not in (None, d // heads):
        raise _refuse("head_dim", c["head_dim"], f"ours is hidden_size / heads = {d // heads}")
    if c.get("attention_dropout", 0.0):
        raise _refuse("attention_dropout", c["attention_dropout"], "our Llama has no dropout")
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        field = "rope_parameters" if "rope_parameters" in c else "rope_scaling"
        raise _refuse(f"{field}.rope_type", kind, "ours is the default rotary embedding")
    return {
        "arch": "llama",
        "vocab_size": c["vocab_size"],
        "n_layer": c["num_hidden_layers"],
        "n_head": heads,
        "n_kv_head": c.get("num_key_value_heads") or heads,
        "d_model": d,
        "ffn_hidden": c["intermediate_size"],
        "max_seq_len": c.get("max_position_embeddings", 2048),
        "rope_theta": float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
        "norm_eps": c.get("rms_norm_eps", 1e-6),
        "tie_embeddings": c.get("tie_word_embeddings", False),
    }


def to_hf_config(m: Any) -> dict[str, Any]:
    """config.json for our model's [model] fields (config.ModelConfig, resolved)."""
    if m.arch == "gpt":
        return {
            "architectures": [HF_ARCHS["gpt2"]],
            "model_type": "gpt2",
            "vocab_size": m.vocab_size,
            "n_layer": m.n_layer,
            "n_head": m.n_head,
            "n_embd": m.d_model,
            "n_positions": m.max_seq_len,
            "n_inner": None,
            "activation_function": "gelu_new" if m.activation == "gelu_tanh" else "gelu",
            "layer_norm_epsilon": 1e-5,
            "resid_pdrop": m.dropout,
            "embd_pdrop": m.dropout,
            "attn_pdrop": m.dropout,
            "tie_word_embeddings": m.tie_embeddings,
        }
    return {
        "architectures": [HF_ARCHS["llama"]],
        "model_type": "llama",
        "vocab_size": m.vocab_size,
        "hidden_size": m.d_model,
        "intermediate_size": m.ffn_hidden,
        "num_hidden_layers": m.n_layer,
        "num_attention_heads": m.n_head,
        "num_key_value_heads": m.n_kv_head or m.n_head,
        "head_dim": m.d_model // m.n_head,
        "max_position_embeddings": m.max_seq_len,
        "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": m.tie_embeddings,
    }


def _pairs(arch: str, n_layer: int) -> list[tuple[str, str, bool]]:
    out = []
    for hf, ours, transposed in NAMES[arch]:
        blocks = range(n_layer) if "{i}" in hf else [None]
        out += [(hf.format(i=i), ours.format(i=i), transposed) for i in blocks]
    return out


def hf_module_names(arch: str, n_layer: int) -> dict[str, str]:
    """Our linear layers' module names -> the Hugging Face model's, where a weight maps
    one to one, untransposed ("blocks.0.attn.q" -> "model.layers.0.self_attn.q_proj")."""
    return {
        ours.removesuffix(".weight"): hf.removesuffix(".weight")
        for hf, ours, transposed in _pairs(arch, n_layer)
        if ours.endswith(".weight") and not transposed
    }


def to_ours(arch: str, n_layer: int, tied: bool, hf: dict[str, torch.Tensor]) -> dict:
    """Our state dict from a Hugging Face one (every name must be there; extra non-buffer
    names are an error: a weight we would drop)."""
    ours, used = {}, set()
    for hf_name, name, transposed in _pairs(arch, n_layer):
        if hf_name == "lm_head.weight" and tied:
            continue
        if hf_name not in hf:
            raise ValueError(f"Hugging Face weights: {hf_name} is missing")
        ours[name] = hf[hf_name].t().contiguous() if transposed else hf[hf_name]
        used.add(hf_name)
    if arch == "gpt":
        prefix, parts = GPT2_QKV
        for i in range(n_layer):
            fused = prefix.format(i=i)
            for kind in ("weight", "bias"):
                value = hf[f"{fused}.{kind}"]  # (d, 3d) Conv1D weight, (3d,) bias
                for part, piece in zip(parts, value.chunk(3, dim=-1), strict=True):
                    piece = piece.t() if kind == "weight" else piece
                    ours[f"blocks.{i}.attn.{part}.{kind}"] = piece.contiguous()
                used.add(f"{fused}.{kind}")
    if tied:
        ours["head.weight"] = ours["tok_emb.weight"]
    extra = [n for n in hf if n not in used and not _causal_mask_buffer(n)]
    if extra:
        raise ValueError(f"Hugging Face weights: {extra[0]} has no place in our {arch} model")
    return ours


def _causal_mask_buffer(name: str) -> bool:
    """Old GPT-2 files carry each block's causal mask as a buffer: not a weight."""
    return name.endswith((".attn.bias", ".attn.masked_bias")) and name.startswith("transformer.h.")


def to_hf(arch: str, n_layer: int, tied: bool, ours: dict[str, torch.Tensor]) -> dict:
    """A Hugging Face state dict from ours (a tied head left out, as save_pretrained does)."""
    hf = {}
    for hf_name, name, transposed in _pairs(arch, n_layer):
        if hf_name == "lm_head.weight" and tied:
            continue
        hf[hf_name] = ours[name].t().contiguous() if transposed else ours[name].contiguous()
    if arch == "gpt":
        prefix, parts = GPT2_QKV
        for i in range(n_layer):
            weights = [ours[f"blocks.{i}.attn.{p}.weight"].t() for p in parts]
            hf[f"{prefix.format(i=i)}.weight"] = torch.cat(weights, dim=-1).contiguous()
            biases = [ours[f"blocks.{i}.attn.{p}.bias"] for p in parts]
            hf[f"{prefix.format(i=i)}.bias"] = torch.cat(biases).contiguous()
    return hf
