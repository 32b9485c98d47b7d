"""What machine a bench ran on, read from it: the CPU's model and widest vector unit, the
kernels ATen chose, the cores, torch's version. Every bench logs it and puts it in its
JSON, so that no figure in docs/benchmarks.md describes a machine nobody can name."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

VECTOR_UNITS = ("avx512f", "avx2", "avx", "sve", "neon", "asimd")  # widest first


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    path = Path("/proc/cpuinfo")
    fields: dict[str, str] = {}
    if not path.exists():
        return fields
    for line in path.read_text().splitlines():
        if not line.strip():
            break
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def machine() -> dict[str, object]:
    info = _cpuinfo()
    flags = set((info.get("flags") or info.get("Features") or "").split())
    return {
        "cpu": info.get("model name") or platform.processor() or platform.machine(),
        "vector_unit": next((unit for unit in VECTOR_UNITS if unit in flags), "unknown"),
        "aten_kernels": torch.backends.cpu.get_cpu_capability(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
    }


def machine_line(m: dict[str, object]) -> str:
    return (
        f"machine: {m['cpu']} ({m['vector_unit']}; ATen kernels {m['aten_kernels']}), "
        f"{m['cores']} cores, torch {m['torch']}"
    )
