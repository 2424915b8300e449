"""Qwen3-MoE's ``config.json`` defaults (transformers' ``Qwen3MoeConfig``): q/k norms, routed experts."""

from raymoe.models.common.config import ConfigDefaults

# head_dim defaults to hidden_size // num_attention_heads here (unlike dense Qwen3's 128).
QWEN3_MOE_DEFAULTS = ConfigDefaults(max_position_embeddings=32768, qk_norm=True, has_moe=True)
