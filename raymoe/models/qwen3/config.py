"""Qwen3's ``config.json`` defaults (transformers' ``Qwen3Config``): head_dim 128, q/k norms, 32768 positions."""

from raymoe.models.common.config import ConfigDefaults

QWEN3_DEFAULTS = ConfigDefaults(max_position_embeddings=32768, head_dim=128, qk_norm=True)
