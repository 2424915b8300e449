"""Which rows make each global batch of a run: seeded shuffles, one per epoch, the same under every layout.

Global batch ``b`` is the ``b % per_epoch``-th slice of epoch ``b // per_epoch``'s shuffle (epoch ``e`` is
``randperm`` under seed ``seed + e``), the short tail of each epoch dropped. So a run resumed at step ``s``
draws exactly the batches the straight run drew from ``s`` on, whatever layout or world size it runs on.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor


def batch_indices(num_rows: int, batch_size: int, seed: int, start: int = 0) -> Iterator[Tensor]:
    """Row indices of successive global batches from batch ``start`` on (see the module docstring)."""
    per_epoch = num_rows // batch_size
    epoch, offset = divmod(start, per_epoch)
    while True:
        order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed + epoch))
        for batch in range(offset, per_epoch):
            yield order[batch * batch_size : (batch + 1) * batch_size]
        epoch, offset = epoch + 1, 0
