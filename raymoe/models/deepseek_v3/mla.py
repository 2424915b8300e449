"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi-K2, Moonlight), in the decoder's attention seat.

Shape legend: ``B`` batch, ``S`` new tokens, ``L`` attended positions, ``H`` hidden size, ``Hq`` heads,
``N`` / ``R`` / ``V`` the no-position, rotated and value channels of a head, ``Cq`` / ``Ckv`` the query and
key/value ranks::

    q       = q_b_proj(q_a_layernorm(q_a_proj(x)))  [B, S, Hq, N + R]   (or q_proj(x) when q_lora_rank is null)
    c, k_r  = kv_a_proj_with_mqa(x)                 [B, S, Ckv], [B, S, R]   (k_r: one rotated key per token)
    k_n, v  = kv_b_proj(kv_a_layernorm(c))          [B, S, Hq, N], [B, S, Hq, V]
    q = [q_n | rope(q_r)],  k = [k_n | rope(k_r) for every head]
    out = o_proj(softmax(q k^T * softmax_scale, causal) v)

With ``rope_interleave`` the rotated channels pair as (0, 1), (2, 3), ...: they are reordered evens-then-odds
before the usual half-split rotation, for queries and keys alike. The cache holds each head's expanded key
and value, so a tensor-parallel rank (its ``q_b_proj`` / ``kv_b_proj`` hold whole heads) caches its heads only.
Heads are read from the projected tensors, never the config.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from raymoe.models.common.config import ModelConfig
from raymoe.models.common.kv_cache import LayerKVCache
from raymoe.models.common.norm import RMSNorm
from raymoe.models.common.rope import apply_rope
from raymoe.models.common.row_attention import AttentionRule, attend_rows
from raymoe.models.common.sequence_split import TokenLayout
from raymoe.models.common.shard_hints import ROPE_DIM_ATTR, SHARD_BLOCK_ATTR


class MultiHeadLatentAttention(nn.Module):
    """Causal MLA of one layer: ``x [B, S, H]`` -> ``[B, S, H]``, the forward of :class:`Attention`."""

    def __init__(self, config: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        mla = config.mla
        if mla is None:
            raise ValueError("MultiHeadLatentAttention needs ModelConfig.mla")
        heads, hidden, bias = config.num_attention_heads, config.hidden_size, config.attention_bias
        self.nope_dim, self.rope_dim, self.v_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.kv_lora_rank = mla.kv_lora_rank
        self.rope_interleave = mla.rope_interleave
        self.scale = mla.softmax_scale
        qk_dim = mla.qk_head_dim
        self.q_proj: nn.Linear | None = None
        self.q_a_proj: nn.Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: nn.Linear | None = None
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, heads * qk_dim, bias=False)
            query_out = self.q_proj
        else:
            self.q_a_proj = nn.Linear(hidden, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, heads * qk_dim, bias=False)
            query_out = self.q_b_proj
            # The query rank feeds a norm over all its features: never split.
            setattr(self.q_a_proj, SHARD_BLOCK_ATTR, mla.q_lora_rank)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, mla.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(mla.kv_lora_rank, heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_dim, hidden, bias=bias)
        # Tensor parallelism splits only whole heads; the compressed kv and the shared rotated key never split.
        setattr(query_out, SHARD_BLOCK_ATTR, qk_dim)
        setattr(self.kv_b_proj, SHARD_BLOCK_ATTR, self.nope_dim + self.v_dim)
        setattr(self.o_proj, SHARD_BLOCK_ATTR, self.v_dim)
        setattr(self.kv_a_proj_with_mqa, SHARD_BLOCK_ATTR, mla.kv_lora_rank + self.rope_dim)
        setattr(self.kv_a_proj_with_mqa, ROPE_DIM_ATTR, self.rope_dim)

    def forward(
        self,
        x_BSH: Tensor,
        cos_SD: Tensor,
        sin_SD: Tensor,
        cache: LayerKVCache | None = None,
        start: int = 0,
        key_mask_BL: Tensor | None = None,
        layout: TokenLayout | None = None,
    ) -> Tensor:
        """As :meth:`Attention.forward`: ``cos/sin`` are of the ``qk_rope_head_dim`` rotated channels."""
        batch, seq, _ = x_BSH.shape
        if self.q_proj is not None:
            q_flat = self.q_proj(x_BSH)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            q_flat = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BSH)))
        q_BHqSD = q_flat.view(batch, seq, -1, self.nope_dim + self.rope_dim).transpose(1, 2)
        q_nope, q_rot = q_BHqSD.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x_BSH).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv_BHqSD = self.kv_b_proj(self.kv_a_layernorm(latent)).view(batch, seq, -1, self.nope_dim + self.v_dim)
        k_nope, v = kv_BHqSD.transpose(1, 2).split([self.nope_dim, self.v_dim], dim=-1)
        k_rot_B1SR = k_rot.view(batch, 1, seq, self.rope_dim)
        if self.rope_interleave:
            q_rot, k_rot_B1SR = _evens_then_odds(q_rot), _evens_then_odds(k_rot_B1SR)
        q_rot, k_rot_B1SR = apply_rope(q_rot, cos_SD, sin_SD), apply_rope(k_rot_B1SR, cos_SD, sin_SD)
        q = torch.cat((q_nope, q_rot), dim=-1)
        k = torch.cat((k_nope, k_rot_B1SR.expand(-1, k_nope.shape[1], -1, -1)), dim=-1)
        rule = AttentionRule(self.scale)
        if layout is not None:  # packed rows, or rows split over ranks (raymoe.models.common.sequence_split)
            out_BHqSV = layout.attend(q, k, v, rule)
        else:
            if cache is not None:
                k, v = cache.update(k, v, start)
            out_BHqSV = attend_rows(q, k, v, rule, start, key_mask_BL)
        out_BSH: Tensor = self.o_proj(out_BHqSV.transpose(1, 2).reshape(batch, seq, -1))
        return out_BSH


def _evens_then_odds(x: Tensor) -> Tensor:
    """Channels (0, 1), (2, 3), ... paired as (i, i + d/2): the evens, then the odds."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
