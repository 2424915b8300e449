"""Key/value cache for incremental decoding.

One :class:`KVCache` per generation holds a :class:`LayerKVCache` per decoder layer. A layer's
buffers are allocated on its first write, from the shapes it is given, so a tensor-parallel rank
that holds only some key/value heads caches only those. Layout ``[B, kv_heads, max_length, D]``.
"""

from __future__ import annotations

import torch
from torch import Tensor


class LayerKVCache:
    """Keys and values of one attention layer, written in place at the positions of new tokens."""

    def __init__(self, max_length: int) -> None:
        self.max_length = max_length
        self.keys: Tensor | None = None
        self.values: Tensor | None = None

    def update(self, keys: Tensor, values: Tensor, start: int) -> tuple[Tensor, Tensor]:
        """Store ``keys/values [B, kv_heads, S, D]`` at ``start..start+S``; return all cached, ``[.., :start+S, D]``."""
        end = start + keys.shape[2]
        if end > self.max_length:
            raise ValueError(f"KV cache overflow: writing positions {start}..{end} into a cache of {self.max_length}")
        if self.keys is None or self.values is None:
            batch, heads, _, head_dim = keys.shape
            self.keys = keys.new_zeros(batch, heads, self.max_length, head_dim)
            self.values = values.new_zeros(batch, heads, self.max_length, values.shape[-1])
        self.keys[:, :, start:end] = keys
        self.values[:, :, start:end] = values
        return self.keys[:, :, :end], self.values[:, :, :end]


class KVCache:
    """Per-layer caches plus ``length``, the number of positions already cached (shared by all layers).

    With left-padded rows the cache also keeps ``key_mask [B, max_length]`` (True: a real token), so
    later steps neither attend to the padding nor count it in a row's positions.
    """

    def __init__(self, num_layers: int, max_length: int) -> None:
        self.max_length = max_length
        self.length = 0
        self.layers = [LayerKVCache(max_length) for _ in range(num_layers)]
        self.key_mask: Tensor | None = None

    def write_mask(self, mask_BS: Tensor) -> Tensor:
        """Record which new positions are real; returns the mask of every cached position, ``[B, length + S]``."""
        end = self.length + mask_BS.shape[1]
        if self.key_mask is None:
            self.key_mask = mask_BS.new_ones(mask_BS.shape[0], self.max_length, dtype=torch.bool)
        self.key_mask[:, self.length : end] = mask_BS.bool()
        return self.key_mask[:, :end]

    def real_tokens(self) -> Tensor | None:
        """``[B]`` real tokens cached so far per row (None: no mask was ever written, every position is real)."""
        return None if self.key_mask is None else self.key_mask[:, : self.length].sum(dim=1)

    def advance(self, num_tokens: int) -> None:
        """Called once per model forward, after every layer wrote its ``num_tokens`` new positions."""
        self.length += num_tokens
