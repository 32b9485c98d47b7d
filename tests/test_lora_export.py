"""A LoRA fine-tune of an imported Llama, out again: merged (`export --format hf
--merge-lora`, and safetensors) and as a PEFT adapter (`--format peft`) that the `peft`
library loads onto the transformers base; logits compared in float64 (nothing downloaded:
the base is a small random transformers model built here, as tests/test_hf.py builds it).

Exact to 1e-10 (float64 on both sides, the same weights):
- PEFT's adapter on the transformers base against our LoRA model: both compute
  W0 x + (alpha / r) B (A x) from the same float32 values;
- the merged export against our LoRA model merged and rounded as the export rounds it:
  W0 + (alpha / r) B A in float64, stored in float32 (tests/test_lora.py checks the merge
  itself in float64 to 1e-12). Against the unmerged model the merged export differs by
  that one rounding, float32's 1e-7 relative, which is checked too.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from paratrain.cli import main
from paratrain.config import resolve
from paratrain.config.toml_file import from_toml_text, to_toml
from paratrain.mesh import Mesh
from paratrain.parallel.lora import merge_lora
from paratrain.train.loop import train
from paratrain.trained.safetensors_file import load_exported
from tests.equivalence import tiny_config, tiny_data
from tests.test_hf import _hf_logits, _import, _llama, _our_model
from tests.test_hf import float64_oracle as float64_oracle  # transformers' RMSNorm in float64

TOL = 1e-10
VOCAB = 256


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An imported base and a LoRA run of 3 steps from it (in this process, dp 1)."""
    tmp = tmp_path_factory.mktemp("lora")
    hf_dir = _llama(tmp, shard=False, vocab=VOCAB)
    _import(hf_dir, tmp / "base")
    cfg = tiny_config(steps=3, init_from=str(tmp / "base"), lora_rank=4, lora_alpha=8.0)
    cfg.model = from_toml_text((tmp / "base" / "config.toml").read_text()).model
    cfg.train.lr = 3e-2
    cfg = resolve(cfg, 1, False)
    (tmp / "run").mkdir()
    (tmp / "run" / "config.toml").write_text(to_toml(cfg))
    train(cfg, Mesh.build(dp=1), tiny_data(), run_dir=tmp / "run")
    return tmp, hf_dir


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(seed))


def _merged_as_exported(model: torch.nn.Module) -> torch.nn.Module:
    """Our LoRA model merged, each weight rounded to float32 as the export stores it."""
    merged = merge_lora(copy.deepcopy(model))
    with torch.no_grad():
        for p in merged.parameters():
            p.copy_(p.float().double())
    return merged


def test_merged_hf_export_equals_our_lora_model(runs):
    tmp, _ = runs
    out = tmp / "merged"
    assert (
        main(["export", str(tmp / "run"), "--format", "hf", "--merge-lora", "--out", str(out)]) == 0
    )
    ids = _ids(1)
    ours = _our_model(tmp / "run")
    with torch.no_grad():
        adapted, merged = ours(ids), _merged_as_exported(ours)(ids)
        base = _our_model(tmp / "base")(ids)
    exported = _hf_logits(out, ids)
    assert (exported - merged).abs().max().item() < TOL
    assert (exported - adapted).abs().max().item() < 1e-5 * adapted.abs().max().item()
    assert (adapted - base).abs().max().item() > 1e-4  # the adapters changed something


def test_merged_safetensors_and_the_unmerged_file(runs):
    tmp, _ = runs
    ids = _ids(2)
    ours = _our_model(tmp / "run")
    for flags, expected in (([], ours), (["--merge-lora"], _merged_as_exported(ours))):
        out = tmp / f"model{len(flags)}.safetensors"
        assert main(["export", str(tmp / "run"), "--out", str(out), *flags]) == 0
        with torch.no_grad():
            diff = load_exported(out).double()(ids) - expected(ids)
        assert diff.abs().max().item() < TOL


def test_peft_loads_the_adapter_onto_the_transformers_base(runs):
    peft = pytest.importorskip("peft")
    tmp, hf_dir = runs
    out = tmp / "adapter"
    assert main(["export", str(tmp / "run"), "--format", "peft", "--out", str(out)]) == 0
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float64)
    model = peft.PeftModel.from_pretrained(base, out).double().eval()
    ids = _ids(3)
    with torch.no_grad():
        theirs, ours = model(ids).logits, _our_model(tmp / "run")(ids)
    assert (theirs - ours).abs().max().item() < TOL
    adapted = [n for n, _ in model.named_modules() if n.endswith("lora_A")]
    assert len(adapted) == 2 * 7  # every projection of both blocks: nothing left out


@pytest.mark.parametrize(
    "run, flags, message",
    [
        ("run", ["--format", "hf"], "is a LoRA run (rank 4); give --merge-lora"),
        ("base", ["--format", "hf", "--merge-lora"], "was not trained with LoRA"),
        ("base", ["--format", "peft"], "was not trained with LoRA"),
        ("run", ["--format", "peft", "--merge-lora"], "--format peft the adapter alone"),
    ],
)
def test_refused_in_one_line(runs, capsys, run, flags, message):
    tmp, _ = runs
    out = tmp / "refused"
    code = main(["export", str(tmp / run), *flags, "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and len(err.splitlines()) == 1, err
    assert not out.exists()
