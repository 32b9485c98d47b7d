"""Every torch factory call in the runtime packages names the device of the tensors it
serves; the few that stay on the host say so here, each with its reason.

A static companion to tests/test_default_device.py (which runs the code): this one reads
it, so a path that no test happens to run is covered too. A call is listed when it names
no device, or a literal CPU one (`device="cpu"`, `torch.device("cpu")`). Tensors made from
other tensors (`x.new_zeros`, `torch.zeros_like`) follow them by construction and are not
factory calls here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import paratrain

ROOT = Path(paratrain.__file__).parent
RUNTIME = ["comm", "parallel", "train", "trained", "checkpoint", "data", "models", "mesh.py"]
FACTORIES = {
    "arange", "as_tensor", "empty", "empty_strided", "eye", "frombuffer", "from_numpy",
    "full", "Generator", "linspace", "ones", "rand", "randint", "randn", "randperm",
    "tensor", "zeros",
}  # fmt: skip

# (file, function, factory) -> why it stays on the host
HOST_SIDE = {
    ("comm/compat.py", "", "ones"):
        "a two-element probe that the installed torch has _foreach_norm/_foreach_mul_",
    ("comm/compat.py", "_total_flops_counted", "ones"):
        "a (2, 3) x (3, 4) probe that the installed torch's FLOP counter still counts",
    ("comm/same_call.py", "_encode", "frombuffer"):
        "the call's signature as bytes; moved to the group's device on the next line",
    ("parallel/data_parallel/powersgd.py", "first_factors", "Generator"):
        "PowerSGD's first Q drawn on the CPU (the same numbers on every rank), then moved",
    ("parallel/data_parallel/powersgd.py", "first_factors", "randn"):
        "PowerSGD's first Q drawn on the CPU (the same numbers on every rank), then moved",
    ("parallel/data_parallel/async_sgd.py", "ParameterServer.reply", "tensor"):
        "header (version, next batch): host-side control message over the gloo group",
    ("parallel/data_parallel/async_sgd.py", "_Inbox.expect", "empty"):
        "header buffer of a worker's next push, over the gloo control group",
    ("parallel/data_parallel/async_sgd.py", "work", "empty"):
        "header buffer from the server, over the gloo control group",
    ("parallel/data_parallel/async_sgd.py", "work", "tensor"):
        "header (version, batch, loss, tokens, stop) to the server, over the gloo control group",
    ("parallel/tensor_parallel/rng.py", "_cpu_state", "Generator"):
        "the CPU random stream's state; CUDA streams are seeded on their device",
    ("train/preemption.py", "Preemption.__call__", "tensor"):
        "the SIGTERM flag, agreed over the gloo control group",
    ("train/prediction_tracker.py", "PredictionTracker.compare", "tensor"):
        "byte counts for the report, gathered over the gloo control group",
    ("train/cuda_memory.py", "cuda_memory", "tensor"):
        "the allocator's byte counts for the summary, gathered over the gloo control group",
    ("checkpoint/whole_model.py", "read_model", "empty"):
        "tensors read from a checkpoint file into host memory, to be written to a file",
    ("data/tokens.py", "_bytes", "frombuffer"):
        "the token stream read from disk; batches move to the device in `on_device`",
    ("data/tokens.py", "load_tokens", "frombuffer"):
        "the token stream read from disk; batches move to the device in `on_device`",
    ("data/tokens.py", "_encoded", "tensor"):
        "the token stream encoded with a tokenizer; batches move to the device in `on_device`",
    ("data/prepared.py", "ShardedTokens.__getitem__", "from_numpy"):
        "windows read from memory-mapped shards; batches move to the device in `on_device`",
    ("trained/run_model.py", "sample", "Generator"):
        "sample runs the model in one process on the host: its draws come from a CPU stream",
    ("trained/run_model.py", "sample", "tensor"):
        "the prompt's ids, for the model sample runs on the host",
    ("trained/run_model.py", "eval_windows", "full"):
        "eval's windows, for the model it runs on the host",
    ("data/document_rows.py", "document_row", "full"):
        "one example's row, padded on the host; batches move to the device in `on_device`",
    ("data/document_rows.py", "packed_row", "full"):
        "a row of packed documents, on the host; batches move to the device in `on_device`",
    ("data/tokens.py", "BatchSampler._order", "Generator"):
        "the data order, drawn on the host so it is the same on every device",
    ("data/tokens.py", "BatchSampler._order", "randperm"):
        "the data order, drawn on the host so it is the same on every device",
    ("parallel/lora.py", "LoraLinear.__init__", "empty"):
        "a LoRA A matrix drawn on the host, the same on every device; copied to the base's",
    ("parallel/lora.py", "apply_lora", "Generator"):
        "the adapters' stream, seeded by the run's seed alone, so every rank draws the same",
}  # fmt: skip


def _is_literal_cpu(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value.split(":")[0] == "cpu"
    if isinstance(node, ast.Call) and node.args:  # torch.device("cpu")
        return _is_literal_cpu(node.args[0])
    return False


class _Finder(ast.NodeVisitor):
    def __init__(self, path: str) -> None:
        self.path, self.scope, self.found = path, [], []

    def _enter(self, node: ast.AST) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _enter

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        if (
            isinstance(f, ast.Attribute)
            and isinstance(f.value, ast.Name)
            and f.value.id == "torch"
            and f.attr in FACTORIES
        ):
            device = next((k.value for k in node.keywords if k.arg == "device"), None)
            if device is None or _is_literal_cpu(device):
                self.found.append((self.path, ".".join(self.scope), f.attr, node.lineno))
        self.generic_visit(node)


def host_side_allocations() -> list[tuple[str, str, str, int]]:
    found = []
    for part in RUNTIME:
        paths = [ROOT / part] if part.endswith(".py") else sorted((ROOT / part).rglob("*.py"))
        for path in paths:
            finder = _Finder(path.relative_to(ROOT).as_posix())
            finder.visit(ast.parse(path.read_text()))
            found += finder.found
    return found


def test_every_allocation_names_its_device_or_is_listed_as_host_side():
    found = host_side_allocations()
    unlisted = [
        f"{p}:{line} {fn}: torch.{f}" for p, fn, f, line in found if (p, fn, f) not in HOST_SIDE
    ]
    assert not unlisted, "allocations that name no device:\n" + "\n".join(unlisted)
    stale = set(HOST_SIDE) - {(p, fn, f) for p, fn, f, _ in found}
    assert not stale, f"listed but no longer found (remove them): {sorted(stale)}"


def test_the_finder_sees_a_missing_device():
    source = (
        "import torch\ndef f(x):\n    a = torch.zeros(3)\n    b = torch.empty(2, device=x.device)\n"
    )
    source += "    c = torch.ones(1, device='cpu')\n"
    finder = _Finder("example.py")
    finder.visit(ast.parse(source))
    assert [(fn, f) for _, fn, f, _ in finder.found] == [("f", "zeros"), ("f", "ones")]
