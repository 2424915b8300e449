"""Which rows make each global batch of a run: seeded shuffles, one per epoch, the same under every layout.

Global batch ``b`` is the ``b % per_epoch``-th slice of epoch ``b // per_epoch``'s shuffle (epoch ``e`` is
``randperm`` under seed ``seed + e``), the short tail of each epoch dropped. So a run resumed at step ``s``
draws exactly the batches the straight run drew from ``s`` on, whatever layout or world size it runs on.

Rows in Ray's object store (``StreamedData``) are shuffled by block (:func:`block_batch_indices`): under the same
seed, epoch ``e`` orders the blocks by one ``randperm`` and then each block's rows by one more, so a global batch
reads one or two blocks and the same resume rule holds::

    blocks  A = rows 0-3, B = rows 4-6      epoch e: blocks B, A -> rows 5 4 6 | 2 0 3 1 -> batches of 2: 5 4, 6 2, ...
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
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


def block_batch_indices(block_of_row: np.ndarray, batch_size: int, seed: int, start: int = 0) -> Iterator[Tensor]:
    """Row indices of successive global batches from batch ``start`` on, for rows in blocks (``block_of_row [N]``:
    each row's block): each epoch's order shuffles the blocks, then the rows inside each (the module docstring)."""
    num_rows = int(block_of_row.shape[0])
    per_epoch = num_rows // batch_size
    by_block = np.argsort(block_of_row, kind="stable")
    _, firsts, counts = np.unique(block_of_row[by_block], return_index=True, return_counts=True)
    groups = [torch.from_numpy(by_block[first : first + count]) for first, count in zip(firsts, counts, strict=True)]
    epoch, offset = divmod(start, per_epoch)
    while True:
        generator = torch.Generator().manual_seed(seed + epoch)
        blocks = torch.randperm(len(groups), generator=generator).tolist()
        order = torch.cat([groups[b][torch.randperm(len(groups[b]), generator=generator)] for b in blocks])
        for batch in range(offset, per_epoch):
            yield order[batch * batch_size : (batch + 1) * batch_size]
        epoch, offset = epoch + 1, 0
