"""Peak memory of this process over a stretch of work: RSS on CPU, ``torch.cuda.max_memory_allocated`` on GPU.

``reset()`` before the stretch (it returns the memory in use then), ``peak_mib()`` after it. On CPU the
kernel's high-water mark of the resident set (``VmHWM``) is reset by writing ``5`` to
``/proc/self/clear_refs`` (Linux >= 4.0), so the figure is the largest RSS *during* the stretch: the
process's baseline (Python, torch, and for a Ray actor its core worker) plus weights, gradients,
optimizer state and activations.
"""

from __future__ import annotations

from pathlib import Path

import torch


def reset(device: torch.device | str = "cpu") -> float:
    """Start a new peak; returns the MiB in use now (RSS, or allocated GPU memory)."""
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated() / 2**20
    Path("/proc/self/clear_refs").write_text("5")
    return _status_mib("VmRSS")


def peak_mib(device: torch.device | str = "cpu") -> float:
    """The largest MiB in use since :func:`reset`."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return _status_mib("VmHWM")


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"/proc/self/status has no {field} line")
