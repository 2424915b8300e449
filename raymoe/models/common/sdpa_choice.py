"""SDPA's backend choice as a trace-time constant, for compiled decoder blocks (:mod:`raymoe.parallel.compiled_blocks`).

``torch._fused_sdp_choice`` on the real tensors returns an int, which dynamo cannot trace: calling it inside a compiled
block breaks the block's graph. :func:`choice_for_traits` asks the same question of fake tensors and is marked
``assume_constant_result``: dynamo runs it once while tracing and keeps the answer as a constant. Its arguments must
be constants, and a compiled block's lengths may be symbolic (a row length that changed compiles a graph with it
symbolic), so the question leaves the lengths out: :func:`call_traits` keeps what SDPA's choice reads apart from
them (dtype, head counts and sizes, whether each last dim is contiguous, the mask's dtype and rank, causality, and
whether the query and key lengths are equal, which dynamo guards on), and the fake tensors take fixed lengths. The
kernels' rules read lengths only as non-zero and, for causal attention, equal or not. A fake CUDA tensor answers by
the device's own rule, the one AOT autograd's SDPA lowering applies to the same call.

Imported by the compiled path only (the decorator imports ``torch._dynamo``, which a process that never compiles,
such as a driver building on ``meta``, does not load).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode

# (dtype, query heads, kv heads, head size, value head size, (q, k, v last dims contiguous), mask (dtype, rank) or
# None, is_causal, query length == key length)
CallTraits = tuple[torch.dtype, int, int, int, int, tuple[bool, bool, bool], tuple[torch.dtype, int] | None, bool, bool]
QUERY_LENGTH = 64  # the fake tensors' lengths: any non-zero length answers alike
KEY_LENGTH_UNEQUAL = 2 * QUERY_LENGTH


def call_traits(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool) -> CallTraits:
    """What SDPA's choice reads of one call of ``q [B, Hq, S, D]``, ``k [B, Hkv, L, D]``, ``v [B, Hkv, L, Dv]`` and
    ``mask`` (None: none), without the lengths (see the module docstring)."""
    contiguous = (q.stride(-1) == 1, k.stride(-1) == 1, v.stride(-1) == 1)
    masked = None if mask is None else (mask.dtype, mask.dim())
    # A branch, not bool(): dynamo guards on the comparison of symbolic lengths and keeps a constant
    square = True if q.shape[-2] == k.shape[-2] else False  # noqa: SIM210
    return q.dtype, q.shape[1], k.shape[1], q.shape[-1], v.shape[-1], contiguous, masked, is_causal, square


@torch.compiler.assume_constant_result
def choice_for_traits(device: torch.device, traits: CallTraits, scale: float) -> int:
    """SDPA's backend choice (an ``SDPBackend`` value) on ``device`` for a call of these traits, with grouped heads
    allowed (``enable_gqa``): asked of fake tensors (:func:`stand_ins`)."""
    with FakeTensorMode():
        q, k, v, mask = stand_ins(traits, device)
        choice = torch._fused_sdp_choice(q, k, v, mask, 0.0, traits[7], scale=scale, enable_gqa=True)
    return int(choice)


def stand_ins(traits: CallTraits, device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Uninitialised ``q, k, v`` and mask (None: none) of a call with these traits, one row and fixed lengths."""
    dtype, heads, kv_heads, dim, value_dim, contiguous, masked, _, square = traits
    length, key_length = QUERY_LENGTH, QUERY_LENGTH if square else KEY_LENGTH_UNEQUAL

    def tensor(shape: tuple[int, ...], last_contiguous: bool, of: torch.dtype) -> Tensor:
        step = 1 if last_contiguous else 2  # a last dim that is not contiguous: every other element
        return torch.empty((*shape[:-1], shape[-1] * step), dtype=of, device=device)[..., ::step]

    q = tensor((1, heads, length, dim), contiguous[0], dtype)
    k = tensor((1, kv_heads, key_length, dim), contiguous[1], dtype)
    v = tensor((1, kv_heads, key_length, value_dim), contiguous[2], dtype)
    mask = None if masked is None else tensor((1,) * (masked[1] - 2) + (length, key_length), True, masked[0])
    return q, k, v, mask
