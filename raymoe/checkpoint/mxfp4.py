"""MXFP4 dequantization for the checkpoint reader: the format and its decoder live with the models
(:mod:`raymoe.models.common.mxfp4`), since LoRA's packed experts decode it inside forward too."""

from raymoe.models.common.mxfp4 import BLOCK_SIZE, BYTES_PER_BLOCK, E2M1_VALUES, dequantize_mxfp4

__all__ = ["BLOCK_SIZE", "BYTES_PER_BLOCK", "E2M1_VALUES", "dequantize_mxfp4"]
