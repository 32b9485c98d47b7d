"""The one module-name pattern grammar (module_names.py) that every model plan uses."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from paratrain.module_names import matching

SRC = Path(__file__).resolve().parents[1] / "src" / "paratrain"


def _model() -> nn.Module:
    block = lambda: nn.ModuleDict({"mlp": nn.ModuleDict({"fc": nn.Linear(2, 2)})})  # noqa: E731
    return nn.ModuleDict({"blocks": nn.ModuleDict({"0": block(), "1": block()}), "head": block()})


def test_a_star_is_one_name_component_and_names_match_whole():
    model = _model()
    assert matching(model, "blocks.*") == ["blocks.0", "blocks.1"]
    assert matching(model, "blocks.*.mlp.fc") == ["blocks.0.mlp.fc", "blocks.1.mlp.fc"]
    assert matching(model, "*.mlp") == ["head.mlp"]  # one component: not blocks.0.mlp
    assert matching(model, "blocks.0.mlp") == ["blocks.0.mlp"]
    assert matching(model, "blocks.0.ml") == []  # whole names only
    assert matching(model, "*") == ["blocks", "head"]  # never the root ("")


def test_no_other_module_parses_patterns():
    """Every strategy names modules through this grammar: none splits on `*` itself."""
    parsers = [p.relative_to(SRC) for p in SRC.rglob("*.py") if 'split("*")' in p.read_text()]
    assert parsers == [Path("module_names.py")]
