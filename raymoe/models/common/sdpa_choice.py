"""SDPA's backend choice as a trace-time constant, for compiled decoder blocks (:mod:`raymoe.parallel.compiled_blocks`).

``torch._fused_sdp_choice`` on the real tensors returns an int, which dynamo cannot trace: calling it inside a compiled
block breaks the block's graph. :func:`choice_for_layouts` asks the same question of fake tensors with the call's
shapes, strides and dtypes, and is marked ``assume_constant_result``: dynamo runs it once while tracing and keeps the
answer as a constant. That is sound because a block compiled with static shapes guards on exactly those properties.
A fake CUDA tensor answers by the device's own rule, the one AOT autograd's SDPA lowering applies to the same call.

Imported by the compiled path only (the decorator imports ``torch._dynamo``, which a process that never compiles,
such as a driver building on ``meta``, does not load).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode

TensorLayout = tuple[tuple[int, ...], tuple[int, ...], torch.dtype]
CallLayouts = tuple[TensorLayout, TensorLayout, TensorLayout, TensorLayout | None]


def tensor_layout(tensor: Tensor) -> TensorLayout:
    """``(shape, strides, dtype)``: what SDPA's choice reads of a tensor."""
    return tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype


def call_layouts(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> CallLayouts:
    """The layouts of one SDPA call's ``q, k, v`` and mask (None: no mask), as :func:`choice_for_layouts` takes them."""
    return tensor_layout(q), tensor_layout(k), tensor_layout(v), None if mask is None else tensor_layout(mask)


@torch.compiler.assume_constant_result
def choice_for_layouts(
    device: torch.device,
    layouts: CallLayouts,
    is_causal: bool,
    scale: float,
) -> int:
    """SDPA's backend choice (an ``SDPBackend`` value) for fake ``q, k, v`` and mask (None: none) of these layouts on
    ``device``, with grouped heads allowed (``enable_gqa``)."""

    def fake(layout: TensorLayout) -> Tensor:
        shape, strides, dtype = layout
        return torch.empty_strided(shape, strides, dtype=dtype, device=device)

    q_layout, k_layout, v_layout, mask_layout = layouts
    with FakeTensorMode():
        mask = None if mask_layout is None else fake(mask_layout)
        choice = torch._fused_sdp_choice(
            fake(q_layout), fake(k_layout), fake(v_layout), mask, 0.0, is_causal, scale=scale, enable_gqa=True
        )
    return int(choice)
