"""Host -> device copies that do not make the host wait (issue 36's sync budget).

A tensor that arrives from the driver lies in pageable host memory; ``tensor.to("cuda")`` from there blocks
the host until the device has run everything queued before it. Pinned first, the copy is queued behind
the device's work and the host goes on::

    to_device(ids_BS, cuda)     pageable --pin (host memcpy)--> pinned --non_blocking--> device
    to_device(ids_BS, cpu)      the tensor itself (no copy)
"""

from __future__ import annotations

import torch
from torch import Tensor


def to_device(tensor: Tensor, device: torch.device) -> Tensor:
    """``tensor`` on ``device`` without waiting for the device (pinned, non-blocking on CUDA)."""
    if tensor.device == device:
        return tensor
    if tensor.device.type == "cpu" and device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
