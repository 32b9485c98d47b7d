"""Golden values of Streaming DiLoCo on a small model (tests/golden/diloco.json): fragments
1 and 2, tau 0 and 1, alpha 0, 0.5 and 1, each run here and in the float64 reference of
tests/test_diloco.py, both held against the file. The file pins the algorithm itself, the
pseudo-gradient's sign included: a change that moved the runtime and the reference alike
(both written from one wrong reading) would still fail here.

    .venv/bin/python -m pytest tests/test_diloco_golden.py --regen-golden   # rewrite it

Kept per case: each group's losses, and per parameter the float64 sum and four elements.
The reference must match the file within 1e-9 relative: float64 rounding of the same
arithmetic through another machine's kernels differs by about 1e-15 per operation, and the
few steps here (SGD inside, no amplification by Adam near zero gradients) keep it far
below. The runtime's float32 values must lie within the reference's float64-measured
tolerance of the file's (tests/equivalence.py `Tolerance`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from paratrain.config import RunConfig
from tests.distributed import run_distributed
from tests.equivalence import tiny_data, train_layouts
from tests.test_diloco import diloco_config, diloco_reference, diloco_training

GOLDEN = Path(__file__).parent / "golden" / "diloco.json"
REFERENCE_RTOL = 1e-9
CASES = [(f, tau, alpha) for f in (1, 2) for tau in (0, 1) for alpha in (0.0, 0.5, 1.0)]


def _config(fragments: int, tau: int, alpha: float) -> RunConfig:
    cfg = diloco_config(2, 2, 0.7, 0.9, True, dp=2, fragments=fragments, sync_delay=tau,
                        merge_alpha=alpha)  # fmt: skip
    cfg.train.optimizer = "sgd"  # linear inside: float64 differences stay tiny
    return cfg


def _summary(losses: list[list[float]], state: dict[str, torch.Tensor]) -> dict:
    """Each group's losses; per parameter its element count, float64 sum and sum of
    magnitudes, and four of its elements."""
    params = {}
    for name, value in sorted(state.items()):
        flat = value.double().reshape(-1)
        picks = [0, flat.numel() // 3, 2 * flat.numel() // 3, flat.numel() - 1]
        params[name] = {
            "n": flat.numel(),
            "sum": flat.sum().item(),
            "abs": flat.abs().sum().item(),
            "at": [flat[i].item() for i in picks],
        }
    return {"losses": losses, "params": params}


def _assert_close(ours: dict, kept: dict, loss_rtol: float, atol: float, case) -> None:
    """Losses within `loss_rtol`; each element within `atol`, a sum within n x atol."""
    for a, b in zip(sum(ours["losses"], []), sum(kept["losses"], []), strict=True):
        assert math.isclose(a, b, rel_tol=loss_rtol), (case, a, b)
    for name, p in kept["params"].items():
        q = ours["params"][name]
        assert abs(q["sum"] - p["sum"]) <= atol * p["n"], (case, name)
        for a, b in zip(q["at"], p["at"], strict=True):
            assert abs(a - b) <= atol, (case, name, a, b)


def test_streaming_diloco_matches_its_golden_values(request):
    configs = [_config(*case) for case in CASES]
    data = tiny_data()
    exact = {}
    for case, cfg in zip(CASES, configs, strict=True):
        groups, _ = diloco_training(cfg, data, torch.float64, 1)
        exact[case] = _summary([g.losses for g in groups], groups[0].state)
    keys = {case: f"fragments={case[0]} tau={case[1]} alpha={case[2]}" for case in CASES}
    if request.config.getoption("--regen-golden"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps({keys[c]: s for c, s in exact.items()}, indent=1) + "\n")
    golden = json.loads(GOLDEN.read_text())
    records = run_distributed(train_layouts, 2, [(2, 1, 1, cfg) for cfg in configs], data)
    for i, (case, cfg) in enumerate(zip(CASES, configs, strict=True)):
        kept = golden[keys[case]]
        scale = max(p["abs"] / p["n"] for p in kept["params"].values())
        _assert_close(exact[case], kept, REFERENCE_RTOL, REFERENCE_RTOL * scale, case)
        tols = [r.tolerance for r in diloco_reference(cfg, data)[0] if r.tolerance is not None]
        loss_rtol, atol = max(t.loss_rtol for t in tols), max(t.param_atol for t in tols)
        runtime = _summary([records[0][i].losses, records[1][i].losses], records[0][i].state)
        _assert_close(runtime, kept, loss_rtol, atol, case)
