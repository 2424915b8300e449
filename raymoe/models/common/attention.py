"""Grouped-query self-attention with a KV cache and the variants the families need.

Optional parts: per-head q/k RMSNorm (Qwen3, GLM-4.5), a sliding window (Mixtral, gpt-oss's
``sliding_attention`` layers), learned sinks (gpt-oss), RoPE on the first ``rotary_dim`` channels of
each head only (GLM-4.5's partial rotary) and biases on q/k/v without one on o (Qwen2-MoE, GLM-4.5).
The window, sinks and scale are the layer's :class:`~raymoe.models.common.row_attention.AttentionRule`; how rows
attend under it is :mod:`raymoe.models.common.row_attention`.

Packed rows (document masking, :mod:`raymoe.models.common.packing`) and rows split over ranks (context
parallelism, :mod:`raymoe.models.common.sequence_split`) come as a *token layout*: the layer hands it its
projected, rotated ``q, k, v`` and its rule, and the layout attends (each document alone; across the ranks).

Shape legend: ``B`` batch, ``S`` new tokens, ``L`` attended positions (cached + new), ``D``
head dim, ``Hq``/``Hkv`` query and key/value heads, ``H`` hidden size. Head counts are read
from the projected tensors, not the config, so a tensor-parallel rank whose ``q_proj`` holds
``Hq / tp`` heads (and whose ``sinks`` holds their ``Hq / tp`` sinks) runs the same code.
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
from raymoe.models.common.shard_hints import INPUT_CONSUMERS_ATTR, SHARD_BLOCK_ATTR


class Attention(nn.Module):
    """Causal self-attention of layer ``layer_idx``: ``x [B, S, H]`` -> ``[B, S, H]``."""

    def __init__(self, config: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.rotary_dim = config.rope_dim  # GLM-4.5: RoPE on the first rotary_dim channels of each head only
        self.scale = config.head_dim**-0.5
        self.sliding_window = config.attention_window(layer_idx)
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, config.num_attention_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, config.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, config.num_key_value_heads * self.head_dim, bias=bias)
        out_bias = bias if config.attention_output_bias is None else config.attention_output_bias
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, hidden, bias=out_bias)
        for projection in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
            # Tensor parallelism may split these only into whole heads; styles check it in validate_param.
            setattr(projection, SHARD_BLOCK_ATTR, self.head_dim)
        setattr(self, INPUT_CONSUMERS_ATTR, ("q_proj", "k_proj", "v_proj"))  # x is theirs alone (forward)
        # Qwen3 normalises each head's query and key before RoPE; Llama does not.
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        # gpt-oss: sinks [Hq], one logit per query head.
        self.sinks = nn.Parameter(torch.empty(config.num_attention_heads)) if config.attention_sinks else None

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
        """``start`` is the index of the first new token (the number of tokens already in ``cache``);
        ``key_mask [B, L]`` (True: a real token) hides left padding from every query; ``layout`` (packed rows, or
        rows split over ranks; no cache) attends in its place."""
        batch, seq, _ = x_BSH.shape
        q_BSHqD = self.q_proj(x_BSH).view(batch, seq, -1, self.head_dim)
        k_BSHkvD = self.k_proj(x_BSH).view(batch, seq, -1, self.head_dim)
        v_BSHkvD = self.v_proj(x_BSH).view(batch, seq, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q_BSHqD, k_BSHkvD = self.q_norm(q_BSHqD), self.k_norm(k_BSHkvD)
        q = apply_partial_rope(q_BSHqD.transpose(1, 2), cos_SD, sin_SD, self.rotary_dim)
        k = apply_partial_rope(k_BSHkvD.transpose(1, 2), cos_SD, sin_SD, self.rotary_dim)
        v = v_BSHkvD.transpose(1, 2)
        if layout is not None:
            out_BHqSD = layout.attend(q, k, v, self.rule())
        else:
            if cache is not None:
                k, v = cache.update(k, v, start)
            out_BHqSD = attend_rows(q, k, v, self.rule(), start, key_mask_BL)
        out_BSH: Tensor = self.o_proj(out_BHqSD.transpose(1, 2).reshape(batch, seq, -1))
        return out_BSH

    def rule(self) -> AttentionRule:
        """This layer's rule, read at forward time (``sinks`` is then a rank's local heads under TP)."""
        return AttentionRule(self.scale, self.sliding_window, self.sinks)


def apply_partial_rope(x_BHSD: Tensor, cos: Tensor, sin: Tensor, rotary_dim: int) -> Tensor:
    """RoPE on the first ``rotary_dim`` channels of each head (``cos/sin`` of that width); the rest pass as they are."""
    if rotary_dim == x_BHSD.shape[-1]:
        return apply_rope(x_BHSD, cos, sin)
    rotated, passed = x_BHSD.split([rotary_dim, x_BHSD.shape[-1] - rotary_dim], dim=-1)
    return torch.cat((apply_rope(rotated, cos, sin), passed), dim=-1)
