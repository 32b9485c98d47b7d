"""The package structure, checked from the source: which module imports which.

The import graph is built with `ast` from every module in src/paratrain, counting every
import: at the top, inside functions, and under TYPE_CHECKING. Checked:
- no circle between modules, nor between packages (a package being a folder; a module
  at the top level is a node of its own);
- the layering of docs/architecture.md: the planner is pure (plan/ imports nothing from
  bench/ or train/); strategies never import a model (parallel/ nothing from models/);
  the comm layer imports nothing above it; models/ import nothing distributed; training
  code does not borrow from the input checker (validate.py) or the benchmarks; the
  configuration and the spawner (spawn.py) are leaves.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = "paratrain"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in (SRC / ROOT).rglob("*.py")}


def _resolve(name: str) -> str | None:
    """The module an import names: itself, or the package it is an attribute of."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str) -> set[str]:
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str | None] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {_resolve(a.name) for a in node.names if a.name.startswith(ROOT)}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, level - 1 steps up
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            if base.startswith(ROOT):
                found |= {_resolve(f"{base}.{a.name}") for a in node.names}
    return {m for m in found if m is not None and m != module}


GRAPH = {m: _imports(m) for m in MODULES}


def _package(module: str) -> str:
    if MODULES[module].name == "__init__.py" or module.count(".") == 1:
        return module  # a package, or a module at the top level
    return module.rpartition(".")[0]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_graph_sees_imports_inside_functions():
    # train/worker.py imports the data loader at the top; a function-level import in the
    # CLI (the launcher starts workers lazily) must be seen too.
    assert "paratrain.train.data" in GRAPH["paratrain.train.worker"]
    assert any(_under(m, "paratrain.train") for m in GRAPH["paratrain.cli"])


def test_no_import_circle_between_modules():
    assert _cycles(GRAPH) == []


def test_no_import_circle_between_packages():
    packages: dict[str, set[str]] = {}
    for module, targets in GRAPH.items():
        mine = _package(module)
        packages.setdefault(mine, set()).update(_package(t) for t in targets if _package(t) != mine)
    assert _cycles(packages) == []


# (importer, what it must not import, why)
FORBIDDEN = [
    ("paratrain.plan", "paratrain.bench", "the planner is pure: formulas, no measurements"),
    ("paratrain.plan", "paratrain.train", "the planner is pure: it never runs a step"),
    ("paratrain.parallel", "paratrain.models", "strategies take model facts as arguments"),
    ("paratrain.parallel", "paratrain.train", "strategies sit below the training loop"),
    ("paratrain.parallel", "paratrain.measure", "instruments are handed to a strategy"),
    ("paratrain.parallel", "paratrain.commands", "a command uses strategies, not the reverse"),
    ("paratrain.parallel", "paratrain.cli", "a command uses strategies, not the reverse"),
    ("paratrain.measure", "paratrain.train", "instruments measure; they never run a step"),
    ("paratrain.comm", "paratrain.parallel", "the comm layer sits below every strategy"),
    ("paratrain.comm", "paratrain.train", "the comm layer sits below the training loop"),
    ("paratrain.models", "paratrain.parallel", "models are plain PyTorch"),
    ("paratrain.models", "paratrain.comm", "models are plain PyTorch"),
    ("paratrain.train", "paratrain.validate", "input checks run before workers start"),
    ("paratrain.train", "paratrain.bench", "training never depends on a benchmark"),
    ("paratrain.config", "paratrain.", "the configuration is a leaf"),
    ("paratrain.spawn", "paratrain.", "the spawner is a leaf: benches and tests share it"),
]


@pytest.mark.parametrize("importer, forbidden, why", FORBIDDEN)
def test_layering(importer, forbidden, why):
    bad = sorted(
        f"{m} -> {t}"
        for m, targets in GRAPH.items()
        if _under(m, importer)
        for t in targets
        if t.startswith(forbidden) and not _under(t, importer)
    )
    assert bad == [], f"{why}: {bad}"


def test_models_import_nothing_distributed():
    for module, path in MODULES.items():
        if not _under(module, "paratrain.models"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n.startswith("torch.distributed") for n in names), module
