"""Attention through SDPA: sinks, windows, padding and grouped kv heads equal the definition in value and in
every gradient (sinks included), and no per-head ``[B, Hq, S, L]`` float tensor is ever allocated for them."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from raymoe.models import parse_model_config
from raymoe.models.common.attention import Attention
from raymoe.models.common.row_attention import causal_attention, masked_attention


def reference_attention(q, k, v, scale, start, window, key_mask, sinks):
    """From the definition: ``softmax([scores | sink_h])[..., :L] @ v`` (no sink column without sinks), the
    scores masked to ``p <= t`` (and ``p > t - window``), padding keys hidden except from their own query."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    seq, length = q.shape[2], k.shape[2]
    t = torch.arange(start, start + seq)[:, None]
    p = torch.arange(length)[None, :]
    allowed = p <= t
    if window is not None:
        allowed = allowed & (p > t - window)
    if key_mask is not None:
        allowed = (allowed & key_mask[:, None, None, :]) | (p == t)
    scores = (q @ k.transpose(2, 3) * scale).masked_fill(~allowed, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1) @ v
    sink_column = sinks.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    probs = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)
    return probs[..., :length] @ v


class LargestFloatTensor(TorchDispatchMode):
    """The largest numel of a floating-point tensor any op returns, forward and backward."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, tuple | list) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
                self.numel = max(self.numel, tensor.numel())
        return out


CASES = {  # start, new tokens S, attended L, window, left padding, Hq, Hkv, value dim
    "train_window_pad_gqa": (0, 12, 12, 5, True, 4, 2, 8),
    "train_full_mha": (0, 12, 12, None, False, 4, 4, 8),
    "prefix_window_pad_gqa": (6, 4, 10, 3, True, 4, 2, 8),
    "decode_window_mqa": (9, 1, 10, 4, False, 4, 1, 8),
    "decode_full_pad_gqa": (9, 1, 10, None, True, 4, 2, 8),
    "value_dim_differs_gqa": (0, 9, 9, 4, True, 4, 2, 5),  # MLA-like: no fused CPU kernel, kv repeated
}


@pytest.mark.parametrize("with_sinks", [True, False], ids=["sinks", "no_sinks"])
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_masked_attention_equals_the_definition_with_gradients(case, with_sinks):
    start, seq, length, window, padded, q_heads, kv_heads, value_dim = case
    gen = torch.Generator().manual_seed(0)
    batch, head_dim, scale = 2, 8, 0.3

    def leaf(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).mul(2).requires_grad_()

    q, k = leaf(batch, q_heads, seq, head_dim), leaf(batch, kv_heads, length, head_dim)
    v, sinks = leaf(batch, kv_heads, length, value_dim), leaf(q_heads)
    key_mask = None
    if padded:
        key_mask = torch.ones(batch, length, dtype=torch.bool)
        key_mask[0, :3] = False
    leaves = (q, k, v, sinks) if with_sinks else (q, k, v)
    weight = torch.randn(batch, q_heads, seq, value_dim, generator=gen, dtype=torch.float64)
    results = []
    for attend in (masked_attention, reference_attention):
        args = (start, scale, window, sinks if with_sinks else None, key_mask)
        if attend is reference_attention:
            args = (scale, start, window, key_mask, sinks if with_sinks else None)
        out = attend(q, k, v, *args)
        grads = torch.autograd.grad((out * weight).sum(), leaves)
        results.append((out, *grads))
    for name, got, want in zip(("out", "q", "k", "v", "sinks"), *results, strict=False):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")


def test_causal_attention_with_grouped_heads_equals_the_definition():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, h, s, 8, generator=gen, dtype=torch.float64) for h, s in ((6, 5), (2, 9), (2, 9)))
    for start, q_rows in ((0, q[:, :, :5]), (4, q[:, :, :5]), (8, q[:, :, :1])):
        keys = start + q_rows.shape[2]
        want = reference_attention(q_rows, k[:, :, :keys], v[:, :, :keys], 0.4, start, None, None, None)
        got = causal_attention(q_rows, k[:, :, :keys], v[:, :, :keys], start, 0.4)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


BATCH, HEADS, KV_HEADS, SEQ, HEAD_DIM = 2, 4, 2, 64, 16
SCORES_NUMEL = BATCH * HEADS * SEQ * SEQ  # one [B, H, S, L] float tensor, L = S


def _gpt_oss_layer() -> Attention:
    config = parse_model_config(
        {
            "model_type": "gpt_oss",
            "vocab_size": 96,
            "hidden_size": 32,
            "intermediate_size": 12,
            "num_hidden_layers": 2,
            "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 16,
        }
    )
    layer = Attention(config, layer_idx=0)  # layer 0: sliding attention, with sinks
    assert layer.sinks is not None and layer.sliding_window == 16
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0, 0.2)
    return layer


def _forward_backward(layer: Attention, key_mask: torch.Tensor | None) -> None:
    x = torch.randn(BATCH, SEQ, 32, requires_grad=True)
    cos, sin = torch.ones(SEQ, HEAD_DIM), torch.zeros(SEQ, HEAD_DIM)
    layer(x, cos, sin, key_mask_BL=key_mask).sum().backward()


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
def test_sink_attention_layer_never_allocates_per_head_scores(padded):
    layer = _gpt_oss_layer()
    key_mask = torch.ones(BATCH, SEQ, dtype=torch.bool)
    key_mask[0, :5] = False
    recorder = LargestFloatTensor()
    with recorder:
        _forward_backward(layer, key_mask if padded else None)
    assert layer.sinks is not None and layer.sinks.grad is not None and layer.sinks.grad.abs().sum() > 0
    assert recorder.numel < SCORES_NUMEL, f"a {recorder.numel}-element float tensor, [B, H, S, L] is {SCORES_NUMEL}"


def test_the_recorder_sees_materialised_scores():
    """Twin of the test above: the definition, which builds [B, H, S, L] probabilities, is caught."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, generator=gen, requires_grad=True)
    k, v = (torch.randn(BATCH, KV_HEADS, SEQ, HEAD_DIM, generator=gen, requires_grad=True) for _ in range(2))
    sinks = torch.randn(HEADS, generator=gen, requires_grad=True)
    recorder = LargestFloatTensor()
    with recorder:
        reference_attention(q, k, v, HEAD_DIM**-0.5, 0, 16, None, sinks).sum().backward()
    assert recorder.numel >= SCORES_NUMEL


@pytest.mark.parametrize("window", [None, 16], ids=["full", "window"])
@pytest.mark.parametrize("with_sinks", [True, False], ids=["sinks", "no_sinks"])
def test_decode_step_does_not_repeat_the_cached_kv_heads(window, with_sinks):
    """One new token over a 256-position cache with 8 query heads on 2 kv heads: no tensor the size of the
    cache repeated to the query heads (``[B, Hq, L, D]``) is made; the kv heads go to SDPA grouped."""
    batch, q_heads, kv_heads, length, head_dim = 1, 8, 2, 256, 16
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(batch, q_heads, 1, head_dim, generator=gen)
    k, v = (torch.randn(batch, kv_heads, length, head_dim, generator=gen) for _ in range(2))
    sinks = torch.randn(q_heads, generator=gen) if with_sinks else None
    key_mask = torch.ones(batch, length, dtype=torch.bool)
    recorder = LargestFloatTensor()
    with recorder:
        out = masked_attention(q, k, v, length - 1, head_dim**-0.5, window, sinks, key_mask)
    repeated = batch * q_heads * length * head_dim
    assert recorder.numel < repeated / 2, f"a {recorder.numel}-element float tensor, the repeated cache is {repeated}"
    want = reference_attention(q, k, v, head_dim**-0.5, length - 1, window, key_mask, sinks)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_sink_gradient_equals_the_definition_in_a_layer():
    """The layer's sinks receive the gradient the definition gives (float32, through the projections)."""
    layer = _gpt_oss_layer()
    x = torch.randn(BATCH, SEQ, 32)
    cos, sin = torch.ones(SEQ, HEAD_DIM), torch.zeros(SEQ, HEAD_DIM)
    layer(x, cos, sin).square().sum().backward()
    assert layer.sinks is not None and layer.sinks.grad is not None
    got = layer.sinks.grad.clone()
    sinks = layer.sinks.detach().clone().requires_grad_()
    split = lambda proj: proj(x).view(BATCH, SEQ, -1, HEAD_DIM).transpose(1, 2)  # noqa: E731
    with torch.no_grad():
        q, k, v = split(layer.q_proj), split(layer.k_proj), split(layer.v_proj)
    out = reference_attention(q, k, v, HEAD_DIM**-0.5, 0, layer.sliding_window, None, sinks)
    layer.o_proj(out.transpose(1, 2).reshape(BATCH, SEQ, -1)).square().sum().backward()
    assert sinks.grad is not None and math.isfinite(float(sinks.grad.abs().sum()))
    torch.testing.assert_close(got, sinks.grad, rtol=1e-4, atol=1e-5)
