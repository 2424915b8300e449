"""Grouped-query self-attention with a KV cache and the variants the families need.

Optional parts: per-head q/k RMSNorm (Qwen3, GLM-4.5), a sliding window (Mixtral, gpt-oss's
``sliding_attention`` layers), learned sinks (gpt-oss), RoPE on the first ``rotary_dim`` channels of
each head only (GLM-4.5's partial rotary) and biases on q/k/v without one on o (Qwen2-MoE, GLM-4.5)::

    scores [B, Hq, S, L] = q k^T * scale, masked: key position p is visible to the query at
    position t when p <= t and, with a window W, p > t - W
    sinks: one logit per head appended to every row before the softmax, then dropped, so it
    takes probability mass without adding a value:  softmax([scores | sink_h])[..., :L] @ v

Every variant runs through ``scaled_dot_product_attention``, so no per-head ``[B, Hq, S, L]`` scores are
ever held (the mask, ``[S, L]`` or ``[B, 1, S, L]`` shared by the heads, is the only ``S x L`` tensor).
Sinks are one extra key that every query sees, with value 0 and score ``sink_h`` (:func:`sink_attention`);
a window drops the keys no new query can see before attending, so a decode step of a windowed layer reads
``W`` cached positions, not all of them. Grouped key/value heads are passed as they are (``enable_gqa``)
wherever a fused kernel takes them.

Packed rows (document masking, :mod:`raymoe.models.common.packing`): a query sees only the keys of
its own document. The documents are unpacked into rows of their own, so windows and sinks act inside
each document exactly as on the document alone; tensor parallelism needs nothing for it (every head of
a rank regroups the same tokens).

Shape legend: ``B`` batch, ``S`` new tokens, ``L`` attended positions (cached + new), ``D``
head dim, ``Hq``/``Hkv`` query and key/value heads, ``H`` hidden size. Head counts are read
from the projected tensors, not the config, so a tensor-parallel rank whose ``q_proj`` holds
``Hq / tp`` heads (and whose ``sinks`` holds their ``Hq / tp`` sinks) runs the same code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend

from raymoe.models.common.config import ModelConfig
from raymoe.models.common.kv_cache import LayerKVCache
from raymoe.models.common.norm import RMSNorm
from raymoe.models.common.packing import PackedDocuments, packed_attention
from raymoe.models.common.rope import apply_rope
from raymoe.models.common.shard_hints import SHARD_BLOCK_ATTR


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
        documents: PackedDocuments | None = None,
    ) -> Tensor:
        """``start`` is the index of the first new token (the number of tokens already in ``cache``);
        ``key_mask [B, L]`` (True: a real token) hides left padding from every query; ``documents`` (packed
        rows, no cache) confines each query to its own document."""
        batch, seq, _ = x_BSH.shape
        q_BSHqD = self.q_proj(x_BSH).view(batch, seq, -1, self.head_dim)
        k_BSHkvD = self.k_proj(x_BSH).view(batch, seq, -1, self.head_dim)
        v_BSHkvD = self.v_proj(x_BSH).view(batch, seq, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q_BSHqD, k_BSHkvD = self.q_norm(q_BSHqD), self.k_norm(k_BSHkvD)
        q = apply_partial_rope(q_BSHqD.transpose(1, 2), cos_SD, sin_SD, self.rotary_dim)
        k = apply_partial_rope(k_BSHkvD.transpose(1, 2), cos_SD, sin_SD, self.rotary_dim)
        v = v_BSHkvD.transpose(1, 2)
        if documents is not None:
            out_BHqSD = packed_attention(q, k, v, documents, lambda q_, k_, v_: self._attend(q_, k_, v_, 0))
        else:
            if cache is not None:
                k, v = cache.update(k, v, start)
            out_BHqSD = self._attend(q, k, v, start, key_mask_BL)
        out_BSH: Tensor = self.o_proj(out_BHqSD.transpose(1, 2).reshape(batch, seq, -1))
        return out_BSH

    def _attend(
        self, q_BHqSD: Tensor, k_BHkvLD: Tensor, v_BHkvLD: Tensor, start: int, key_mask_BL: Tensor | None = None
    ) -> Tensor:
        if self.sinks is None and self.sliding_window is None and key_mask_BL is None:
            return causal_attention(q_BHqSD, k_BHkvLD, v_BHkvLD, start, self.scale)
        return masked_attention(
            q_BHqSD, k_BHkvLD, v_BHkvLD, start, self.scale, self.sliding_window, self.sinks, key_mask_BL
        )


def apply_partial_rope(x_BHSD: Tensor, cos: Tensor, sin: Tensor, rotary_dim: int) -> Tensor:
    """RoPE on the first ``rotary_dim`` channels of each head (``cos/sin`` of that width); the rest pass as they are."""
    if rotary_dim == x_BHSD.shape[-1]:
        return apply_rope(x_BHSD, cos, sin)
    rotated, passed = x_BHSD.split([rotary_dim, x_BHSD.shape[-1] - rotary_dim], dim=-1)
    return torch.cat((apply_rope(rotated, cos, sin), passed), dim=-1)


def causal_attention(q_BHqSD: Tensor, k_BHkvLD: Tensor, v_BHkvLD: Tensor, start: int, scale: float) -> Tensor:
    """Query ``i`` (position ``start + i``) attends to keys at positions ``<= start + i``."""
    seq, length = q_BHqSD.shape[2], k_BHkvLD.shape[2]
    if seq == length:  # no cached prefix: the square causal mask
        return grouped_attention(q_BHqSD, k_BHkvLD, v_BHkvLD, scale, is_causal=True)
    if seq == 1:  # one new token sees every cached position
        return grouped_attention(q_BHqSD, k_BHkvLD, v_BHkvLD, scale)
    # SDPA's is_causal aligns the mask top-left, wrong with a cached prefix: build it explicitly.
    allowed_SL = visible_keys(seq, length, start, None, q_BHqSD.device)
    return grouped_attention(q_BHqSD, k_BHkvLD, v_BHkvLD, scale, allowed_SL)


def masked_attention(
    q_BHqSD: Tensor,
    k_BHkvLD: Tensor,
    v_BHkvLD: Tensor,
    start: int,
    scale: float,
    window: int | None,
    sinks_Hq: Tensor | None,
    key_mask_BL: Tensor | None = None,
) -> Tensor:
    """Causal attention with an optional sliding ``window``, per-head ``sinks`` and padding ``key_mask``
    (see the module docstring). A padding query sees itself, so its (unused) row stays finite."""
    seq, device = q_BHqSD.shape[2], q_BHqSD.device
    first = 0 if window is None else max(0, start - window + 1)  # no new query sees a key before it
    k_BHkvLD, v_BHkvLD = k_BHkvLD[:, :, first:], v_BHkvLD[:, :, first:]
    length = first + k_BHkvLD.shape[2]
    allowed = visible_keys(seq, length, start, window, device, first)  # [S, L - first]
    if key_mask_BL is not None:
        query_pos = torch.arange(start, start + seq, device=device)
        own_SL = torch.arange(first, length, device=device)[None, :] == query_pos[:, None]
        allowed = (allowed & key_mask_BL[:, None, None, first:]) | own_SL  # [B, 1, S, L - first]
    if sinks_Hq is None:
        return grouped_attention(q_BHqSD, k_BHkvLD, v_BHkvLD, scale, allowed)
    return sink_attention(q_BHqSD, k_BHkvLD, v_BHkvLD, scale, allowed, sinks_Hq)


def sink_attention(
    q_BHqSD: Tensor, k_BHkvLD: Tensor, v_BHkvLD: Tensor, scale: float, allowed: Tensor, sinks_Hq: Tensor
) -> Tensor:
    """``softmax([scores | sink_h])[..., :L] @ v`` with ``allowed`` (bool, ``[S, L]`` or ``[B, 1, S, L]``)
    masking the scores, through SDPA: ``[B, Hq, S, Dv]``, exact in value and in every gradient (sinks included).

    The sink is a virtual key at position ``L`` that every query sees, with value 0. Its score must be
    ``sink_h``, which differs per query head while keys are per kv head, so the head's sink rides in the query:
    one extra channel (index ``D``) holds ``sink_h / scale`` in the query, 0 in every real key and 1 in the
    virtual key (whose other channels are 0), so ``scale * q.k`` is the real score for a real key and ``sink_h`` for the
    virtual one. Channels are padded with zeros to a common width ``W``, a multiple of 8 (kernel alignment;
    the values too, since fused kernels want one head dim), and the output is cut back to ``Dv``.
    """
    batch, heads, seq, head_dim = q_BHqSD.shape
    value_dim = v_BHkvLD.shape[-1]
    width = -(-(max(head_dim, value_dim) + 1) // 8) * 8
    sink_BHqS1 = (sinks_Hq / scale).to(q_BHqSD.dtype).view(1, heads, 1, 1).expand(batch, heads, seq, 1)
    q_BHqSW = torch.cat([q_BHqSD, sink_BHqS1, q_BHqSD.new_zeros(batch, heads, seq, width - head_dim - 1)], dim=-1)
    virtual_BHkv1W = k_BHkvLD.new_zeros(1, 1, 1, width)
    virtual_BHkv1W[..., head_dim] = 1.0
    virtual_BHkv1W = virtual_BHkv1W.expand(batch, k_BHkvLD.shape[1], 1, width)
    k_BHkvLW = torch.cat([F.pad(k_BHkvLD, (0, width - head_dim)), virtual_BHkv1W], dim=2)  # L + 1 keys
    v_BHkvLW = F.pad(v_BHkvLD, (0, width - value_dim, 0, 1))  # the virtual key's value: 0
    allowed_with_sink = F.pad(allowed, (0, 1), value=True)
    out_BHqSW = grouped_attention(q_BHqSW, k_BHkvLW, v_BHkvLW, scale, allowed_with_sink)
    return out_BHqSW[..., :value_dim]


def grouped_attention(
    q_BHqSD: Tensor,
    k_BHkvLD: Tensor,
    v_BHkvLD: Tensor,
    scale: float,
    allowed: Tensor | None = None,
    is_causal: bool = False,
) -> Tensor:
    """SDPA where query head ``h`` reads kv head ``h // (Hq / Hkv)``: ``[B, Hq, S, Dv]``.

    The kv heads go in as they are (``enable_gqa``) unless no fused kernel takes grouped heads for this call
    (on CUDA the memory-efficient kernel, the one that takes a mask, does not): then they are repeated to
    ``Hq``, which is what SDPA's math backend would do anyway, and the fused kernel runs on the copies.
    """
    groups = q_BHqSD.shape[1] // k_BHkvLD.shape[1]
    if groups > 1:
        choice = torch._fused_sdp_choice(
            q_BHqSD, k_BHkvLD, v_BHkvLD, allowed, 0.0, is_causal, scale=scale, enable_gqa=True
        )
        if choice == SDPBackend.MATH.value:
            k_BHkvLD, v_BHkvLD = k_BHkvLD.repeat_interleave(groups, 1), v_BHkvLD.repeat_interleave(groups, 1)
    return F.scaled_dot_product_attention(
        q_BHqSD, k_BHkvLD, v_BHkvLD, attn_mask=allowed, is_causal=is_causal, scale=scale, enable_gqa=True
    )


def visible_keys(seq: int, length: int, start: int, window: int | None, device: torch.device, first: int = 0) -> Tensor:
    """``[S, L - first]`` bool: the query at ``t = start + i`` sees key ``p`` (``first <= p < L``) iff ``p <= t``
    (and ``p > t - window``)."""
    key_pos = torch.arange(first, length, device=device)
    query_pos = torch.arange(start, start + seq, device=device)
    allowed_SL = key_pos[None, :] <= query_pos[:, None]
    if window is not None:
        allowed_SL &= key_pos[None, :] > query_pos[:, None] - window
    return allowed_SL
