"""What this machine has, asked without loading torch where the answer allows: whether a
CUDA device may be present, and how much memory a rank can use.

A refusal must answer before torch loads (several seconds here), so `cuda_known` looks for
the driver's device files first and answers None (only torch can say) when they exist;
validate/check.py then checks both answers before it asks torch.
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


def cuda_known() -> bool | None:
    """torch.cuda.is_available() where it is known without loading torch: False with no
    driver, torch's answer once torch is loaded; None where only loading torch can say."""
    if "torch" in sys.modules:
        import torch

        return torch.cuda.is_available()
    return None if cuda_driver_present() else False


def cuda_available() -> bool:
    """torch.cuda.is_available(), without importing torch where no driver is present."""
    known = cuda_known()
    if known is not None:
        return known
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
