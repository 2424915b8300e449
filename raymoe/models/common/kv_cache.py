"""Key/value cache for incremental decoding.

One :class:`KVCache` per generation holds a :class:`LayerKVCache` per decoder layer. A layer's
buffers are allocated on its first write, from the shapes it is given, so a tensor-parallel rank
that holds only some key/value heads caches only those. Layout ``[B, kv_heads, max_length, D]``.
"""

from __future__ import annotations

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
    """Per-layer caches plus ``length``, the number of positions already cached (shared by all layers)."""

    def __init__(self, num_layers: int, max_length: int) -> None:
        self.max_length = max_length
        self.length = 0
        self.layers = [LayerKVCache(max_length) for _ in range(num_layers)]

    def advance(self, num_tokens: int) -> None:
        """Called once per model forward, after every layer wrote its ``num_tokens`` new positions."""
        self.length += num_tokens
