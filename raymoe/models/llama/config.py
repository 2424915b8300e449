"""Llama's ``config.json`` defaults (transformers' ``LlamaConfig``): 2048 positions, optional MLP biases."""

from raymoe.models.common.config import ConfigDefaults

LLAMA_DEFAULTS = ConfigDefaults(max_position_embeddings=2048, has_mlp_bias=True)
