"""Qwen3 (dense): Llama's decoder with per-head q/k RMSNorm, the ``qwen3`` model type."""

from raymoe.models.common.family import ModelFamily
from raymoe.models.qwen3.config import QWEN3_DEFAULTS
from raymoe.models.qwen3.model import Qwen3ForCausalLM

FAMILY = ModelFamily("qwen3", QWEN3_DEFAULTS, Qwen3ForCausalLM)

__all__ = ["FAMILY", "QWEN3_DEFAULTS", "Qwen3ForCausalLM"]
