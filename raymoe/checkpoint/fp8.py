"""Block-scaled FP8 dequantization (DeepSeek-V3 / Kimi-K2 checkpoints, ``quantization_config.quant_method: fp8``).

A quantized weight ``W [R, C]`` is stored as two hub tensors::

    <name>            float8_e4m3fn [R, C]
    <name>_scale_inv  float32 [ceil(R / br), ceil(C / bc)]   one scale per (br x bc) block, (128, 128) on the hub

    W[r, c] = float(<name>[r, c]) * <name>_scale_inv[r // br, c // bc]

The product is formed in float32 (an e4m3 value is exact there); the reader then casts to the parameter's
dtype. A block of ``W`` needs only the scales of the blocks it overlaps.
"""

from __future__ import annotations

import torch
from torch import Tensor

FP8_DTYPE = "F8_E4M3"  # safetensors' name of float8_e4m3fn
SCALE_DTYPES = ("F32", "BF16")
DEQUANTIZED_DTYPE = "F32"  # what FP8 parameters read as


def dequantize_fp8_block(weight: Tensor, scale_inv: Tensor, block: tuple[int, int], offset: tuple[int, int]) -> Tensor:
    """``weight`` fp8 ``[r, c]`` (rows and columns from ``offset`` of the whole tensor) times the scales of its blocks.

    ``scale_inv`` holds the scales of the blocks the part overlaps, starting with the block of ``offset``.
    """
    rows, cols = weight.shape
    (block_rows, block_cols), (row0, col0) = block, offset
    row_block = (torch.arange(rows) + row0) // block_rows - row0 // block_rows
    col_block = (torch.arange(cols) + col0) // block_cols - col0 // block_cols
    scales = scale_inv.float()[row_block][:, col_block]
    return weight.float() * scales
