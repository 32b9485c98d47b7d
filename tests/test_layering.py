"""The package structure, checked from the source: which module imports which.

The import graph is built with `ast` from every module in src/paratrain, counting every
import: at the top, inside functions, and under TYPE_CHECKING. Checked:
- no circle between modules, nor between packages (a package being a folder; a module
  at the top level is a node of its own);
- the layering of docs/architecture.md: the planner is pure (plan/ imports nothing from
  bench/ or train/); strategies never import a model (parallel/ nothing from models/);
  the comm layer imports nothing above it; models/ import nothing distributed; training
  code does not borrow from the input checker (validate/) or the benchmarks; the
  configuration and the spawner (spawn.py) are leaves;
- sizes: no file over 300 lines, no function over 60 (small files with one job).
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
    # train command (it loads the launcher and the worker only when it runs) must be seen.
    assert "paratrain.data.tokens" in GRAPH["paratrain.train.worker"]
    assert "paratrain.train.worker" in GRAPH["paratrain.commands.train"]


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
    ("paratrain.train", "paratrain.trained", "training never depends on the offline tools"),
    ("paratrain.trained", "paratrain.commands", "a command uses the offline tools"),
    ("paratrain.config", "paratrain.", "the configuration is a leaf"),
    # The checks run before any worker: they may build a schedule or read a model's plan,
    # never start training, and a command calls them, not the reverse.
    ("paratrain.validate", "paratrain.train", "the checks run before any worker starts"),
    ("paratrain.validate", "paratrain.commands", "a command calls the checks"),
    ("paratrain.data", "paratrain.train", "data is read before and apart from training"),
    ("paratrain.checkpoint", "paratrain.train", "checkpoints are read apart from training"),
    ("paratrain.data", "paratrain.parallel", "data knows no strategy"),
    ("paratrain.data", "paratrain.comm", "data knows no process group"),
    # (save compat, a leaf over torch alone: the names its forkserver preloads)
    ("paratrain.spawn", "paratrain.", "the spawner is a leaf: benches and tests share it"),
    ("paratrain.simulate", "paratrain.validate", "the command checks input before processes"),
    ("paratrain.simulate", "paratrain.bench", "a simulation builds what train builds"),
    ("paratrain.simulate", "paratrain.commands", "a command uses the simulation"),
    ("paratrain.simulate", "paratrain.cli", "a command uses the simulation"),
    ("paratrain.train", "paratrain.simulate", "training never depends on its simulation"),
    ("paratrain.plan", "paratrain.simulate", "the planner is pure: it never runs a step"),
]


# Leaf to leaf: compat imports torch alone (checked below).
LEAVES_ALLOWED = {("paratrain.spawn", "paratrain.comm.compat")}


def test_compat_imports_nothing_of_paratrain():
    assert not [t for t in GRAPH["paratrain.comm.compat"] if t.startswith("paratrain")]


@pytest.mark.parametrize("importer, forbidden, why", FORBIDDEN)
def test_layering(importer, forbidden, why):
    bad = sorted(
        f"{m} -> {t}"
        for m, targets in GRAPH.items()
        if _under(m, importer)
        for t in targets
        if t.startswith(forbidden) and not _under(t, importer) and (m, t) not in LEAVES_ALLOWED
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


def _public_definitions(module: str) -> set[str]:
    """The classes and functions `module` defines at the top level, not starting with '_'."""
    tree = ast.parse(MODULES[module].read_text())
    kinds = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {n.name for n in tree.body if isinstance(n, kinds) and not n.name.startswith("_")}


def _bench(module: str) -> str | None:
    """The bench folder of a module under bench/ (not harness/, which every bench shares)."""
    parts = module.split(".")
    if len(parts) > 3 and parts[1] == "bench" and parts[2] != "harness":
        return parts[2]
    return None


# Names several modules may define, and why. Keep it short: a new duplicate gets a name
# that says what it is, not a line here.
SHARED_NAMES = {
    # the entry point of a runnable module (`python -m ...`, the console script)
    "main": "each runnable module's entry point",
    # comm/ring.py and comm/tree.py are interchangeable algorithm modules, always called
    # through the module (`ring.all_reduce_`, `tree.all_reduce_`)
    "all_reduce_": "the same operation in each algorithm module",
    # comm/ordering.py is the stream-level twin of p2p.py and call.py: its send, recv and
    # run_ours are only ever called as `ordering.X` from those modules
    "send": "ordering.send: the stream-level twin of p2p.send",
    "recv": "ordering.recv: the stream-level twin of p2p.recv",
    "run_ours": "ordering.run_ours: the stream-level twin of call.run_ours",
}


# What every commands/ module defines: cli.py calls them as command(name).run(args).
COMMAND_PROTOCOL = {"add_arguments", "run"}


def _duplicates() -> dict[str, list[str]]:
    """Public top-level names defined in more than one module, with the modules. Two
    benches (bench/X and bench/Y) may share a name: each bench folder is a namespace of
    its own (a `summarize` or `measure` per bench) and no bench imports another's."""
    where: dict[str, list[str]] = {}
    for module in sorted(MODULES):
        for name in _public_definitions(module):
            where.setdefault(name, []).append(module)
    out = {}
    for name, modules in where.items():
        if len(modules) < 2 or name in SHARED_NAMES:
            continue
        if name in COMMAND_PROTOCOL and all(_under(m, "paratrain.commands") for m in modules):
            continue  # every command module's, called through the registry (cli.py)
        benches = [_bench(m) for m in modules]
        if None not in benches and len(set(benches)) == len(benches):
            continue  # one per bench folder
        out[name] = modules
    return out


def test_no_public_name_is_defined_in_two_modules():
    assert _duplicates() == {}


def test_the_shared_names_are_still_shared():
    # an allowlist entry whose duplicate is gone must go too
    counts: dict[str, int] = {}
    for module in MODULES:
        for name in _public_definitions(module):
            counts[name] = counts.get(name, 0) + 1
    assert [n for n in SHARED_NAMES if counts.get(n, 0) < 2] == []


# --- sizes: small files with one job ------------------------------------------------------

MAX_FILE_LINES, MAX_FUNCTION_LINES = 300, 60  # issue 29: the house's rooms stay small


def _sizes() -> tuple[list[str], list[str]]:
    files, functions = [], []
    for path in sorted((SRC / ROOT).rglob("*.py")):
        text = path.read_text()
        name = path.relative_to(SRC)
        if text.count("\n") > MAX_FILE_LINES:
            files.append(f"{name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    functions.append(f"{name}:{node.lineno} {node.name}: {length} lines")
    return files, functions


def test_no_file_over_300_lines_and_no_function_over_60():
    files, functions = _sizes()
    assert files == [] and functions == [], "split by concern:\n" + "\n".join(files + functions)
