"""Hugging Face checkpoints in and out: small random models built here with `transformers`
(nothing downloaded), imported, and compared with `transformers` itself in float64.

- GPT-2 (tied head, GPT-2's tanh GELU, fused q/k/v in Conv1D layers) and Llama (grouped-
  query attention, untied), each saved by `save_pretrained` (Llama also in several shards),
  imported with `paratrain import-hf`: our model's logits equal transformers' to 1e-10.
- `paratrain export --format hf` of the imported run: `AutoModelForCausalLM.from_pretrained`
  loads it, with the same logits.
- A config we cannot represent is refused in one line naming the field, writing nothing.

transformers' LlamaRMSNorm computes in float32 whatever its input (it casts to float32
and back), which caps any comparison with it at float32's 1e-7; the oracle here runs it in
float64 (`_rms_norm_in_float64`), its only change, so that 1e-10 compares the models and
not that cast. Its rotary angles are float32 by design, as ours are, in the same order.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import transformers

from paratrain import checkpoint
from paratrain.checkpoint.whole_model import load_weights, read_model
from paratrain.cli import main
from paratrain.config import RunConfig
from paratrain.config.toml_file import from_toml_text
from paratrain.train.build import build_model

TOL = 1e-10


def _gpt2(tmp: Path) -> Path:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4, tie_word_embeddings=True
    )
    model = transformers.GPT2LMHeadModel(config).double().eval()
    model.save_pretrained(tmp / "hf-gpt2")
    return tmp / "hf-gpt2"


def _llama(tmp: Path, shard: bool = True, vocab: int = 96) -> Path:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
    )
    model = transformers.LlamaForCausalLM(config).double().eval()
    with torch.no_grad():  # RMSNorm weights start at one: make them count
        for p in model.parameters():
            if p.dim() == 1:  # float32 values, as every weight here (checkpoints are fp32)
                p.copy_(torch.randn(p.shape).mul(0.1).add(1.0).double())
    model.save_pretrained(tmp / "hf-llama", max_shard_size="40KB" if shard else "10GB")
    return tmp / "hf-llama"


def _rms_norm_in_float64(self, hidden_states: torch.Tensor) -> torch.Tensor:
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


@pytest.fixture(autouse=True)
def float64_oracle(monkeypatch):
    monkeypatch.setattr(
        transformers.models.llama.modeling_llama.LlamaRMSNorm, "forward", _rms_norm_in_float64
    )


def _hf_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    with torch.no_grad():
        return model(ids).logits


def _our_model(run_dir: Path) -> torch.nn.Module:
    cfg = from_toml_text((run_dir / "config.toml").read_text())
    model = build_model(cfg).double().eval()
    weights = read_model(checkpoint.latest_checkpoint(run_dir).path)
    load_weights(model, {k: v.double() for k, v in weights.items()}, str(run_dir))
    return model


def _import(hf_dir: Path, out: Path) -> None:
    assert main(["import-hf", str(hf_dir), "--out", str(out)]) == 0


@pytest.mark.parametrize("make", [_gpt2, _llama], ids=["gpt2-tied", "llama-gqa-sharded"])
def test_an_import_computes_the_same_logits_as_transformers(tmp_path, make):
    hf_dir = make(tmp_path)
    _import(hf_dir, tmp_path / "run")
    ids = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = _our_model(tmp_path / "run")(ids)
    expected = _hf_logits(hf_dir, ids)
    assert (ours - expected).abs().max().item() < TOL
    assert expected.abs().max().item() > 1e-3  # not a comparison of zeros


@pytest.mark.parametrize("make", [_gpt2, _llama], ids=["gpt2-tied", "llama-gqa"])
def test_an_export_loads_in_transformers_with_the_same_logits(tmp_path, make):
    hf_dir = make(tmp_path)
    _import(hf_dir, tmp_path / "run")
    out = tmp_path / "exported"
    assert main(["export", str(tmp_path / "run"), "--format", "hf", "--out", str(out)]) == 0
    ids = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(2))
    assert (_hf_logits(out, ids) - _hf_logits(hf_dir, ids)).abs().max().item() < TOL
    with torch.no_grad():
        ours = _our_model(tmp_path / "run")(ids)
    assert (_hf_logits(out, ids) - ours).abs().max().item() < TOL


def test_a_config_we_cannot_represent_is_refused_in_one_line(tmp_path, capsys):
    hf_dir = _llama(tmp_path, shard=False)
    config = json.loads((hf_dir / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}
    (hf_dir / "config.json").write_text(json.dumps(config))
    capsys.readouterr()  # transformers' own progress bars
    code = main(["import-hf", str(hf_dir), "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "rope_parameters.rope_type = 'llama3'" in err
    assert not (tmp_path / "run").exists()  # nothing written


def test_an_import_is_a_run_directory_with_the_models_config(tmp_path):
    _import(_llama(tmp_path, shard=False), tmp_path / "run")
    cfg = from_toml_text((tmp_path / "run" / "config.toml").read_text())
    expected = {"arch": "llama", "n_kv_head": 2, "ffn_hidden": 48, "name": "custom"}
    assert {k: getattr(cfg.model, k) for k in expected} == expected
    assert [c.step for c in checkpoint.complete_checkpoints(tmp_path / "run")] == [0]
    assert (
        dataclasses.asdict(cfg.model)
        == checkpoint.read_meta(checkpoint.checkpoint_path(tmp_path / "run", 0))["model"]
    )
    assert isinstance(cfg, RunConfig)


def train_from(rank, world, cfg, data):
    from paratrain.mesh import Mesh
    from paratrain.train.loop import train

    mesh = Mesh.build(tp=world)
    return [m.loss for m in train(cfg, mesh, data).metrics]


def test_a_run_starts_from_an_imports_weights_on_any_mesh(tmp_path):
    from paratrain.data.tokens import BatchSampler
    from paratrain.validate import resolve_and_check
    from tests.distributed import run_distributed
    from tests.equivalence import tiny_config, tiny_data

    _import(_llama(tmp_path, shard=False, vocab=256), tmp_path / "run")
    cfg = tiny_config(steps=1, init_from=str(tmp_path / "run"))
    cfg.model = from_toml_text((tmp_path / "run" / "config.toml").read_text()).model
    cfg.parallel.nproc, cfg.parallel.tp, cfg.parallel.dp = 2, 2, 1
    cfg.train.microbatches = 0
    cfg = resolve_and_check(cfg, 2)
    losses = run_distributed(train_from, 2, cfg, tiny_data())
    batch = BatchSampler(tiny_data().train, 16, 8, cfg.train.seed).global_batch_at(0)
    with torch.no_grad():
        expected = _our_model(tmp_path / "run").float()(batch[:, :-1], batch[:, 1:]).item()
    for mine in losses:  # every tp rank, the imported weights split over tp
        assert abs(mine[0] - expected) < 1e-5 * expected
    cfg.train.init_from = ""  # the same run from the seed's weights: another loss
    assert abs(run_distributed(train_from, 2, cfg, tiny_data())[0][0] - expected) > 1e-3


@pytest.mark.parametrize("make", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_greedy_decoding_with_and_without_the_kv_cache_matches_transformers(tmp_path, make):
    from paratrain.models.generate import generate

    hf_dir = make(tmp_path)
    _import(hf_dir, tmp_path / "run")
    ours = _our_model(tmp_path / "run")
    prompt = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(3))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float64)
    hf_model.generation_config.eos_token_id = None  # no stop token: 12 new tokens, as ours
    expected = hf_model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),  # every prompt token is real, id 0 too
        max_new_tokens=12,
        do_sample=False,
        pad_token_id=0,
    )
    cached = generate(ours, prompt, 12)
    uncached = generate(ours, prompt, 12, use_cache=False)
    assert torch.equal(cached, uncached)
    assert torch.equal(cached, expected)


def test_the_cache_gives_the_logits_of_the_whole_prefix(tmp_path):
    from paratrain.models.kv_cache import KVCache

    for make in (_gpt2, _llama):
        hf_dir = make(tmp_path / make.__name__)
        _import(hf_dir, tmp_path / make.__name__ / "run")
        model = _our_model(tmp_path / make.__name__ / "run")
        ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(4))
        with torch.no_grad():
            whole = model(ids)
            cache = KVCache(len(model.blocks))
            pieces = [model(ids[:, :5], cache=cache), model(ids[:, 5:9], cache=cache)]
            pieces += [model(ids[:, i : i + 1], cache=cache) for i in range(9, 12)]
        assert (torch.cat(pieces, dim=1) - whole).abs().max().item() < TOL
