"""Next-token cross-entropy for causal LMs."""

from __future__ import annotations

from typing import Literal

import torch.nn.functional as F
from torch import Tensor

IGNORE_INDEX = -100


def causal_lm_loss(
    logits_BSV: Tensor, labels_BS: Tensor, ignore_index: int = IGNORE_INDEX, reduction: Literal["mean", "sum"] = "mean"
) -> Tensor:
    """Cross-entropy of predicting ``labels[:, t + 1]`` from ``logits[:, t]``, in float32.

    Label positions equal to ``ignore_index`` (padding, prompt tokens) do not count. ``"sum"``
    lets data-parallel ranks divide by the token count of the whole global batch instead of
    their own, so the mean over all ranks equals one process's mean.
    """
    # Shift the labels, not the logits: slicing [B, S, V] logits would copy them (and their gradient).
    return token_loss(logits_BSV, next_in_row(labels_BS, ignore_index), ignore_index, reduction)


def token_loss(
    logits_BSV: Tensor, targets_BS: Tensor, ignore_index: int = IGNORE_INDEX, reduction: Literal["mean", "sum"] = "mean"
) -> Tensor:
    """Cross-entropy of ``targets[:, t]`` from ``logits[:, t]`` (already aligned: the token each position predicts),
    in float32; ``ignore_index`` targets do not count. For tokens that are not whole rows (a rank's share of them
    under context parallelism), whose next token may live elsewhere."""
    logits_NV = logits_BSV.float().reshape(-1, logits_BSV.shape[-1])
    return F.cross_entropy(logits_NV, targets_BS.reshape(-1), ignore_index=ignore_index, reduction=reduction)


def next_in_row(values_BS: Tensor, fill: float) -> Tensor:
    """``[B, S]``: entry ``t`` is ``values[:, t + 1]`` (what position ``t`` predicts), the last entry ``fill``."""
    return F.pad(values_BS[:, 1:], (0, 1), value=fill)


def count_label_tokens(labels_BS: Tensor, ignore_index: int = IGNORE_INDEX) -> int:
    """How many targets :func:`causal_lm_loss` averages over (every label but the first of each row)."""
    return int((labels_BS[:, 1:] != ignore_index).sum())
