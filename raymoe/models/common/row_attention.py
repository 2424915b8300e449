"""Scaled-dot-product attention of whole rows under a layer's rule: causal, with an optional sliding window, learned
sinks and a padding mask.

Shape legend: ``B`` batch, ``S`` new tokens, ``L`` attended positions (cached + new), ``D`` head dim, ``Dv`` value
head dim, ``Hq``/``Hkv`` query and key/value heads::

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

An :class:`AttentionRule` is what a layer's attention is besides its projections (scale, window, sinks); everything
that attends for a layer (whole rows here, packed documents, a sequence split over ranks) takes the rule, so the
layer says it once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend


@dataclass(frozen=True)
class AttentionRule:
    """How a layer's queries attend besides causality: ``scale`` multiplies ``q k^T``, ``window`` (None: every
    earlier key) bounds how far back a query sees, ``sinks_Hq`` (None: none) are the per-head sink logits of the
    heads being computed (a rank's heads under tensor parallelism)."""

    scale: float
    window: int | None = None
    sinks_Hq: Tensor | None = None

    def heads(self, first: int, count: int) -> AttentionRule:
        """The rule of query heads ``[first, first + count)`` of the ones it was made for (their sinks)."""
        if self.sinks_Hq is None:
            return self
        return AttentionRule(self.scale, self.window, self.sinks_Hq[first : first + count])


def attend_rows(
    q_BHqSD: Tensor,
    k_BHkvLD: Tensor,
    v_BHkvLD: Tensor,
    rule: AttentionRule,
    start: int = 0,
    key_mask_BL: Tensor | None = None,
) -> Tensor:
    """``[B, Hq, S, Dv]``: rows whose first new token is at position ``start`` (``L - S`` cached before it) attend
    under ``rule``; ``key_mask [B, L]`` (True: a real token) hides left padding."""
    if rule.sinks_Hq is None and rule.window is None and key_mask_BL is None:
        return causal_attention(q_BHqSD, k_BHkvLD, v_BHkvLD, start, rule.scale)
    return masked_attention(q_BHqSD, k_BHkvLD, v_BHkvLD, start, rule.scale, rule.window, rule.sinks_Hq, key_mask_BL)


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
    if groups > 1 and not _fused_kernel_takes_groups(q_BHqSD, k_BHkvLD, v_BHkvLD, scale, allowed, is_causal):
        k_BHkvLD, v_BHkvLD = k_BHkvLD.repeat_interleave(groups, 1), v_BHkvLD.repeat_interleave(groups, 1)
    return F.scaled_dot_product_attention(
        q_BHqSD, k_BHkvLD, v_BHkvLD, attn_mask=allowed, is_causal=is_causal, scale=scale, enable_gqa=True
    )


def _fused_kernel_takes_groups(
    q_BHqSD: Tensor, k_BHkvLD: Tensor, v_BHkvLD: Tensor, scale: float, allowed: Tensor | None, is_causal: bool
) -> bool:
    """Whether SDPA runs this grouped-head call on a fused kernel (else: its math backend, which repeats the kv heads).

    Eager asks SDPA's own choice. Inside a compiled block that call is a graph break (an int dynamo cannot trace), so
    there: on CPU, yes (the compiled block calls the CPU flash kernel, which takes grouped heads, as eager does); on
    CUDA, the same choice asked of fake tensors, a constant at trace time (:mod:`.sdpa_choice`)."""
    if not torch.compiler.is_compiling():
        choice = torch._fused_sdp_choice(
            q_BHqSD, k_BHkvLD, v_BHkvLD, allowed, 0.0, is_causal, scale=scale, enable_gqa=True
        )
        return bool(choice != SDPBackend.MATH.value)
    if q_BHqSD.device.type == "cpu":
        return True
    # imported here, while dynamo traces: the module loads torch._dynamo, which an eager process never needs
    from raymoe.models.common.sdpa_choice import call_traits, choice_for_traits

    traits = call_traits(q_BHqSD, k_BHkvLD, v_BHkvLD, allowed, is_causal)
    return bool(choice_for_traits(q_BHqSD.device, traits, scale) != SDPBackend.MATH.value)


def visible_keys(seq: int, length: int, start: int, window: int | None, device: torch.device, first: int = 0) -> Tensor:
    """``[S, L - first]`` bool: the query at ``t = start + i`` sees key ``p`` (``first <= p < L``) iff ``p <= t``
    (and ``p > t - window``)."""
    key_pos = torch.arange(first, length, device=device)
    query_pos = torch.arange(start, start + seq, device=device)
    allowed_SL = key_pos[None, :] <= query_pos[:, None]
    if window is not None:
        allowed_SL &= key_pos[None, :] > query_pos[:, None] - window
    return allowed_SL
