"""LoRA applied from outside (parallel/lora.py), in one process: the layer's arithmetic in
float64, the frozen base, the adapters' initialisation from the seed, --init-from a base
checkpoint, resume from a LoRA run's checkpoint, and the refusals before any worker."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from paratrain.checkpoint import latest_checkpoint, read_meta
from paratrain.checkpoint.store import checkpoint_path
from paratrain.checkpoint.whole_model import write_model
from paratrain.config import resolve
from paratrain.mesh import Mesh
from paratrain.models.plans import GPT_PLAN, LLAMA_PLAN
from paratrain.parallel.lora import LoraLinear, apply_lora, merge_lora
from paratrain.train.build import build_model
from paratrain.train.loop import train
from paratrain.validate import resolve_and_check
from tests.equivalence import record_of, tiny_config, tiny_data


def lora_cfg(**train):
    return tiny_config(**{"lora_rank": 4, "lora_alpha": 8.0, **train})


def test_layer_computes_base_plus_scaled_low_rank_update():
    """h = W0 x + b + (alpha / r) B A x, in float64 to rounding (1e-12 relative)."""
    torch.manual_seed(0)
    base = nn.Linear(6, 5).double()
    layer = LoraLinear(base, rank=2, alpha=3.0, generator=torch.Generator().manual_seed(1))
    x = torch.randn(3, 6, dtype=torch.float64)
    assert torch.equal(layer(x), base(x)), "B starts at zero: the adapted layer is the base"
    with torch.no_grad():
        layer.lora_B.weight.normal_()
    a, b = layer.lora_A.weight, layer.lora_B.weight
    expected = x @ base.weight.T + base.bias + 1.5 * (x @ a.T @ b.T)
    torch.testing.assert_close(layer(x), expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(merge_lora(nn.Sequential(layer))[0](x), expected,
                               rtol=1e-12, atol=1e-12)  # fmt: skip


def test_adapters_as_peft_initialises_them_from_the_seed():
    """A: nn.Linear's default, Kaiming uniform with a = sqrt(5), bound 1/sqrt(in); B: 0.
    The same seed gives the same adapters, another seed others."""
    model = build_model(lora_cfg())
    q = model.get_submodule("blocks.0.attn.q")
    assert isinstance(q, LoraLinear)
    bound = 1 / math.sqrt(q.in_features)
    assert q.lora_A.weight.abs().max() <= bound and q.lora_A.weight.std() > bound / 3
    assert not q.lora_B.weight.any()
    again = build_model(lora_cfg())
    other = build_model(lora_cfg(seed=7))
    a = q.lora_A.weight
    assert torch.equal(again.get_submodule("blocks.0.attn.q").lora_A.weight, a)
    assert not torch.equal(other.get_submodule("blocks.0.attn.q").lora_A.weight, a)


def test_base_frozen_and_adapter_names_peft_style():
    model = build_model(lora_cfg())
    trained = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    targets = [n.removeprefix("blocks.*.") for n in GPT_PLAN.lora_targets]
    assert trained == sorted(f"blocks.{i}.{t}.lora_{ab}.weight" for i in range(2)
                             for t in targets for ab in "AB")  # fmt: skip
    assert LLAMA_PLAN.lora_targets and all(
        p.startswith("blocks.*.") for p in LLAMA_PLAN.lora_targets
    )


def test_targets_given_by_pattern():
    model = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4)})
    assert apply_lora(model, ["b"], 2, 2.0, 0) == ["b"]
    assert isinstance(model["b"], LoraLinear) and not isinstance(model["a"], LoraLinear)
    assert not model["a"].weight.requires_grad


def test_init_from_a_base_checkpoint_with_fresh_adapters(tmp_path):
    """The base loads from the checkpoint (an import-hf's step-0 checkpoint is written
    the same way); the adapters are those the seed draws, whatever the base."""
    source = build_model(tiny_config(seed=99))
    write_model(checkpoint_path(tmp_path, 0), source, {"step": 0})
    cfg = lora_cfg()
    cfg.train.init_from = str(tmp_path)
    model = build_model(cfg)
    fresh = build_model(lora_cfg())
    state, base = model.state_dict(), source.state_dict()
    for name, t in state.items():
        want = fresh.state_dict()[name] if ".lora_" in name else base[name]
        assert torch.equal(t, want), name


@pytest.mark.parametrize("zero", [0, 3])  # the base whole in the module; in ZeRO-3's units
def test_resume_from_a_lora_checkpoint_continues_exactly(tmp_path, zero):
    """4 steps straight equal 2 steps, a checkpoint, and 2 more from it (bitwise: the same
    layout, the same arithmetic), frozen base included: the base came from --init-from,
    which a resume does not read again, so the checkpoint must hold it."""
    data = tiny_data()
    write_model(checkpoint_path(tmp_path / "base", 0), build_model(tiny_config(seed=99)), {})
    cfg = lora_cfg(checkpoint_every=2, init_from=str(tmp_path / "base"))
    cfg.parallel.zero = zero
    cfg = resolve(cfg, 1, False)
    mesh = Mesh.build(dp=1)
    straight = record_of(train(cfg, mesh, data, run_dir=tmp_path / "a"), mesh.group("tp"))
    ckpt = latest_checkpoint(tmp_path / "a")
    assert ckpt is not None and ckpt.step == 4
    two = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=2))
    train(two, mesh, data, run_dir=tmp_path / "b")
    first = latest_checkpoint(tmp_path / "b")
    assert first is not None and first.step == 2
    resumed = record_of(train(cfg, mesh, data, run_dir=tmp_path / "b", resume=first),
                        mesh.group("tp"))  # fmt: skip
    assert resumed.losses == straight.losses[2:]
    for name, t in straight.state.items():
        assert torch.equal(resumed.state[name], t), name


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"lora_targets": "blocks.*.attn.qkv"}, "--lora-targets 'blocks.*.attn.qkv' matches no"),
        ({"lora_targets": "blocks.*.ln1"}, "a LayerNorm; LoRA adapts linear layers only"),
        ({"lora_rank": 33}, "--lora-rank 33 exceeds blocks.0.attn.q's 32 -> 32 (at most 32)"),
        ({"lora_rank": -1}, "--lora-rank -1 must be 0 or more"),
        ({"lora_alpha": 0.0}, "--lora-alpha 0.0 must be positive"),
        ({"optimizer": "muon"}, "--lora-rank 4 with --optimizer muon"),
    ],
)
def test_refused_before_any_worker(flags, message):
    cfg = lora_cfg(**flags)
    with pytest.raises(ValueError) as e:
        resolve_and_check(cfg, 1)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_refused_on_a_mixture_of_experts():
    cfg = lora_cfg()
    cfg.model.num_experts = 4
    with pytest.raises(ValueError, match=r"--lora-rank 4 with --num-experts 4: .* dense model"):
        resolve_and_check(cfg, 1)


def test_planner_counts_frozen_base_and_adapters():
    """plan/lora.py against its formula by hand: llama3-8b, rank 16 on all 7 matrices of a
    block, mixed precision, dp 8: the base 2 bytes a parameter (1/8 under ZeRO-3), the
    adapters 2 + 2 + 8 + 4 bytes."""
    from paratrain.plan.layout import PRECISIONS, Layout, LoraSpec, Workload
    from paratrain.plan.lora import adapter_params, lora_model_state
    from paratrain.plan.model import model_preset

    model = model_preset("llama3-8b")
    h, kv, f = 4096, 1024, 14336
    per_block = 16 * (2 * (h + h) + 2 * (kv + h) + 2 * (f + h) + (h + f))
    lora = LoraSpec(16, tuple(range(7)))
    assert adapter_params(model, lora) == 32 * per_block
    work = Workload(precision=PRECISIONS["mixed"], lora=lora)
    a, n = 32 * per_block, model.params
    z3 = lora_model_state(model, lora, work, Layout(dp=8, zero=3))
    assert z3.params == 2 * -(-n // 8) + 2 * -(-a // 8)
    assert (z3.grads, z3.optimizer, z3.master) == (2 * (a // 8), 8 * (a // 8), 4 * (a // 8))
    dp = lora_model_state(model, lora, work, Layout(dp=8, zero=0))
    assert dp.total == 2 * n + 16 * a


def test_resume_with_other_lora_settings_is_refused(tmp_path):
    from paratrain.checkpoint.compatible import check_compatible
    from paratrain.checkpoint.planner import CheckpointMismatch

    data, cfg = tiny_data(), resolve(lora_cfg(steps=1), 1, False)
    train(cfg, Mesh.build(dp=1), data, run_dir=tmp_path)
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt is not None
    meta = read_meta(ckpt.path)
    check_compatible(meta, cfg, ckpt.path)  # the same settings resume
    other = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, lora_rank=8))
    with pytest.raises(CheckpointMismatch, match="train.lora_rank = 8 but the checkpoint has 4"):
        check_compatible(meta, other, ckpt.path)
    full = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, lora_rank=0))
    with pytest.raises(CheckpointMismatch, match="train.lora_rank = 0 but the checkpoint has 4"):
        check_compatible(meta, full, ckpt.path)
    # and a GPT's adapter has no PEFT form (transformers' GPT-2 fuses q, k and v)
    from paratrain.cli import main

    assert main(["export", str(tmp_path), "--format", "peft", "--out", str(tmp_path / "a")]) == 2
    assert not (tmp_path / "a").exists()


def test_mixed_precision_keeps_the_base_frozen_in_bf16_as_the_planner_counts():
    """bf16 under ZeRO-3: the base sharded in bf16 with no master copy, the adapters with
    theirs; the measured model state is the planner's (plan/lora.py)."""
    from paratrain.train.prediction import predict

    cfg = lora_cfg(dtype="bfloat16", steps=2)
    cfg.parallel.zero = 3
    cfg = resolve(cfg, 1, False)
    result = train(cfg, Mesh.build(dp=1), tiny_data())
    measured = result.extra["model_state_bytes"]
    assert measured == {k: predict(cfg).model_state[0][k] for k in measured}
    frozen = result.engine.replicas[0].frozen_units
    assert frozen and all(u.shard.param.dtype == torch.bfloat16 for u in frozen)
    assert all(u.shard.master is None and not u.shard.grad.numel() for u in frozen)
