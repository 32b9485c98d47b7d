"""What this machine has, asked without loading torch where the answer allows: whether a
CUDA device may be present, and how much memory a rank can use.

A refusal must answer before torch loads (several seconds here), so `cuda_available` looks
for the driver's device files first and asks torch only when they exist.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Present whenever a CUDA (NVIDIA) or ROCm (AMD, torch.cuda too) driver is loaded.
_DRIVER_FILES = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia", "/dev/kfd")


def cuda_driver_present() -> bool:
    """A GPU driver is loaded here: whether CUDA works then only torch can say."""
    return any(Path(p).exists() for p in _DRIVER_FILES)


def cuda_available() -> bool:
    """torch.cuda.is_available(), without importing torch where no driver is present."""
    if "torch" not in sys.modules and not cuda_driver_present():
        return False
    import torch

    return torch.cuda.is_available()


def host_memory_bytes() -> int | None:
    """The memory the processes here can use: MemAvailable from /proc/meminfo, else the
    physical pages (os.sysconf); None where neither answers."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def cuda_memory_bytes() -> int | None:
    """Total memory of CUDA device 0 (every rank gets a device like it), or None."""
    if not cuda_available():
        return None
    import torch

    return int(torch.cuda.get_device_properties(0).total_memory)
