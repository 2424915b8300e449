"""Qwen2-MoE (Qwen/Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B), the ``qwen2_moe`` model type."""

from raymoe.models.common.family import ModelFamily
from raymoe.models.qwen2_moe.config import QWEN2_MOE_DEFAULTS, parse_qwen2_moe_config
from raymoe.models.qwen2_moe.model import Qwen2MoeForCausalLM

FAMILY = ModelFamily("qwen2_moe", QWEN2_MOE_DEFAULTS, Qwen2MoeForCausalLM, parse=parse_qwen2_moe_config)

__all__ = ["FAMILY", "QWEN2_MOE_DEFAULTS", "Qwen2MoeForCausalLM"]
