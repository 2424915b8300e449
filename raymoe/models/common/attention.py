"""Grouped-query self-attention with optional per-head q/k RMSNorm (Qwen3) and a KV cache.

Shape legend: ``B`` batch, ``S`` new tokens, ``L`` attended positions (cached + new), ``D``
head dim, ``Hq``/``Hkv`` query and key/value heads, ``H`` hidden size. Head counts are read
from the projected tensors, not the config, so a tensor-parallel rank whose ``q_proj`` holds
``Hq / tp`` heads runs the same code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from raymoe.models.common.config import ModelConfig
from raymoe.models.common.kv_cache import LayerKVCache
from raymoe.models.common.norm import RMSNorm
from raymoe.models.common.rope import apply_rope
from raymoe.models.common.shard_hints import SHARD_BLOCK_ATTR


class Attention(nn.Module):
    """Causal self-attention: ``x [B, S, H]`` -> ``[B, S, H]``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, config.num_attention_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, config.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, config.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, hidden, bias=bias)
        for projection in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
            # Tensor parallelism may split these only into whole heads; styles check it in validate_param.
            setattr(projection, SHARD_BLOCK_ATTR, self.head_dim)
        # Qwen3 normalises each head's query and key before RoPE; Llama does not.
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self, x_BSH: Tensor, cos_SD: Tensor, sin_SD: Tensor, cache: LayerKVCache | None = None, start: int = 0
    ) -> Tensor:
        """``start`` is the position of the first new token (the number of tokens already in ``cache``)."""
        batch, seq, _ = x_BSH.shape
        q_BSHqD = self.q_proj(x_BSH).view(batch, seq, -1, self.head_dim)
        k_BSHkvD = self.k_proj(x_BSH).view(batch, seq, -1, self.head_dim)
        v_BSHkvD = self.v_proj(x_BSH).view(batch, seq, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q_BSHqD, k_BSHkvD = self.q_norm(q_BSHqD), self.k_norm(k_BSHkvD)
        q = apply_rope(q_BSHqD.transpose(1, 2), cos_SD, sin_SD)
        k = apply_rope(k_BSHkvD.transpose(1, 2), cos_SD, sin_SD)
        v = v_BSHkvD.transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v, start)
        out_BHqSD = _causal_attention(q, k, v, start, self.scale)
        out_BSH: Tensor = self.o_proj(out_BHqSD.transpose(1, 2).reshape(batch, seq, -1))
        return out_BSH


def _causal_attention(q_BHqSD: Tensor, k_BHkvLD: Tensor, v_BHkvLD: Tensor, start: int, scale: float) -> Tensor:
    """Query ``i`` (position ``start + i``) attends to keys at positions ``<= start + i``."""
    groups = q_BHqSD.shape[1] // k_BHkvLD.shape[1]
    if groups > 1:  # query head h reads kv head h // groups
        k_BHkvLD = k_BHkvLD.repeat_interleave(groups, dim=1)
        v_BHkvLD = v_BHkvLD.repeat_interleave(groups, dim=1)
    seq, length = q_BHqSD.shape[2], k_BHkvLD.shape[2]
    if seq == length:  # no cached prefix: the square causal mask
        return F.scaled_dot_product_attention(q_BHqSD, k_BHkvLD, v_BHkvLD, is_causal=True, scale=scale)
    if seq == 1:  # one new token sees every cached position
        return F.scaled_dot_product_attention(q_BHqSD, k_BHkvLD, v_BHkvLD, scale=scale)
    # SDPA's is_causal aligns the mask top-left, wrong with a cached prefix: build it explicitly.
    key_pos = torch.arange(length, device=q_BHqSD.device)
    query_pos = torch.arange(start, start + seq, device=q_BHqSD.device)
    allowed_SL = key_pos[None, :] <= query_pos[:, None]
    return F.scaled_dot_product_attention(q_BHqSD, k_BHkvLD, v_BHkvLD, attn_mask=allowed_SL, scale=scale)
