"""Qwen3-MoE (Qwen/Qwen3-30B-A3B, Qwen3-235B-A22B), the ``qwen3_moe`` model type."""

from raymoe.models.common.family import ModelFamily
from raymoe.models.qwen3_moe.config import QWEN3_MOE_DEFAULTS
from raymoe.models.qwen3_moe.model import Qwen3MoeForCausalLM

FAMILY = ModelFamily("qwen3_moe", QWEN3_MOE_DEFAULTS, Qwen3MoeForCausalLM)

__all__ = ["FAMILY", "QWEN3_MOE_DEFAULTS", "Qwen3MoeForCausalLM"]
