"""Every private or version-dependent torch name goes through paratrain.comm.compat, and
each of compat's names resolves on the installed torch (2.11.0 to 2.14.1: pyproject.toml).

A new torch release then changes one file: the scan below finds a private name anywhere
else in the package, and `compat.missing()` names what the installed torch lacks.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import paratrain
from paratrain.comm import compat

pytestmark = pytest.mark.equivalence  # run on every supported torch too

PACKAGE = Path(paratrain.__file__).parent
COMPAT = PACKAGE / "comm" / "compat.py"
# A private torch name as code spells it: an attribute or module of torch's beginning with
# one underscore (torch._foreach_mul_, torch.utils._pytree, nn.modules.dropout._DropoutNd,
# torch._C._profiler), or a private name imported from torch. Dunders (__version__) are not.
PRIVATE = re.compile(
    r"\b(?:torch|dist|nn|distributed_c10d|Variable)(?:\.[A-Za-z0-9]\w*)*\._[A-Za-z]"
    r"|\bfrom torch[\w.]* import [^#\n]*\b_[A-Za-z]"
    r"|_get_default_store|_execution_engine|experimental\._"
)


def private_uses(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if PRIVATE.search(line)]


@pytest.mark.parametrize(
    "line, private",
    [
        ("torch._foreach_mul_(xs, 2)", True),
        ("import torch._dynamo.config as dynamo_config", True),
        ("from torch._C._profiler import RecordScope, _EventType", True),
        ("from torch.utils._python_dispatch import TorchDispatchMode", True),
        ("isinstance(m, nn.modules.dropout._DropoutNd)", True),
        ("dist.distributed_c10d._get_default_store()", True),
        ("from torch.distributed.tensor.experimental._attention import x", True),
        ("torch.autograd.Variable._execution_engine.queue_callback(f)", True),
        ("torch.__version__", False),
        ("from torch.utils.checkpoint import checkpoint", False),
        ("self._flush_queued = True", False),
    ],
)
def test_the_scan_sees_private_names(line, private):
    assert bool(private_uses(line)) is private


def test_no_file_but_compat_uses_a_private_torch_name():
    found = {
        str(path.relative_to(PACKAGE)): uses
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != COMPAT and (uses := private_uses(path.read_text()))
    }
    assert found == {}, "move these behind paratrain/comm/compat.py: " + repr(found)


def test_every_compat_name_resolves_on_this_torch():
    assert compat.missing() == []


def test_importing_the_seams_leaves_dynamo_unimported():
    """`compat.graph_break` defers torch._dynamo (0.8 s of CPU per process) to a seam's
    first call: the launcher and its checks import every module that declares a seam and
    import none of dynamo. (A training process imports it anyway when it builds torch's
    optimizer.) Under torch.compile the seams break the graph: test_compile.py counts
    those breaks."""
    code = (
        "import sys, torch\n"
        "import paratrain.comm.regions, paratrain.parallel.tensor_parallel.rng\n"
        "import paratrain.commands.train, paratrain.train.fits\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
