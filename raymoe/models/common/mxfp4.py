"""MXFP4 dequantization: 4-bit e2m1 values in blocks of 32 with one e8m0 power-of-two scale per block.

A quantized tensor ``W [..., R, C]`` (``C = G * 32``) is stored as two uint8 hub tensors::

    <name>_blocks [..., R, G, 16]   each byte holds two e2m1 codes: low nibble first, high nibble second
    <name>_scales [..., R, G]       e8m0 exponent s of the block: scale = 2 ** (s - 127) (s = 255 is NaN)

    W[..., r, 32 * g + 2 * b]     = E2M1_VALUES[blocks[..., r, g, b] & 0xF] * scale[..., r, g]
    W[..., r, 32 * g + 2 * b + 1] = E2M1_VALUES[blocks[..., r, g, b] >> 4]  * scale[..., r, g]

e2m1 is 1 sign, 2 exponent and 1 mantissa bit; its 16 codes are the 8 magnitudes below, then their
negatives. A value times a power of two is exact in float32 and, within bfloat16's exponent range
(all of e8m0's), in bfloat16.
"""

from __future__ import annotations

from functools import cache

import torch
from torch import Tensor

BLOCK_SIZE = 32  # values per scale
BYTES_PER_BLOCK = BLOCK_SIZE // 2  # two 4-bit codes per byte
CHUNK_WEIGHTS = 1 << 26  # weights decoded at once (about 400 MiB of temporaries)

# The value of each e2m1 code 0..15.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: Tensor, scales: Tensor, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """``blocks`` uint8 ``[..., R, G, 16]`` and ``scales`` uint8 ``[..., R, G]`` -> ``[..., R, G*32]`` in ``dtype``.

    Decoded in float32 (exact), then rounded once to ``dtype``, ``CHUNK_WEIGHTS`` weights at a time: the
    temporaries (int32 codes, float32 values: about 6 bytes a weight) stay bounded however large the tensor (a
    whole layer's experts, dequantized inside forward when they are kept packed).
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 3 or blocks.shape[-1] != BYTES_PER_BLOCK or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not fit: "
            f"expected blocks [..., R, G, {BYTES_PER_BLOCK}] and scales [..., R, G]"
        )
    groups = blocks.shape[-2]
    out = torch.empty(*blocks.shape[:-2], groups * BLOCK_SIZE, dtype=dtype, device=blocks.device)
    rows_out, rows_blocks, rows_scales = (
        out.view(-1, groups * BLOCK_SIZE),
        blocks.reshape(-1, groups, 16),
        scales.reshape(-1, groups),
    )
    step = max(1, CHUNK_WEIGHTS // max(1, groups * BLOCK_SIZE))
    pairs, e8m0 = _tables(blocks.device)
    for start in range(0, rows_out.shape[0], step):
        values = pairs[rows_blocks[start : start + step].int()]  # [rows, G, 16, 2]
        values.mul_(e8m0[rows_scales[start : start + step].int()][..., None, None])
        rows_out[start : start + step] = values.reshape(values.shape[0], -1)
    return out


@cache
def _tables(device: torch.device) -> tuple[Tensor, Tensor]:
    """``[256, 2]`` the (low, high) values of each byte, ``[256]`` each e8m0 scale: made once per device (a forward
    that dequantizes packed experts would otherwise copy them to the device every call)."""
    codes = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    pairs = torch.stack((codes.repeat(16), codes.repeat_interleave(16)), dim=-1)  # byte -> (low, high) values
    powers = [2.0 ** (s - 127) for s in range(255)] + [float("nan")]
    return pairs, torch.tensor(powers, dtype=torch.float32, device=device)
