"""DeepSeek-V3 (deepseek-ai/DeepSeek-V3, DeepSeek-R1, and the same architecture in Kimi-K2 / Moonlight checkpoints
that name it), the ``deepseek_v3`` model type."""

from raymoe.models.common.family import ModelFamily
from raymoe.models.deepseek_v3.config import DEEPSEEK_V3_DEFAULTS, parse_deepseek_v3_config
from raymoe.models.deepseek_v3.model import DeepseekV3ForCausalLM

FAMILY = ModelFamily("deepseek_v3", DEEPSEEK_V3_DEFAULTS, DeepseekV3ForCausalLM, parse=parse_deepseek_v3_config)

__all__ = ["DEEPSEEK_V3_DEFAULTS", "FAMILY", "DeepseekV3ForCausalLM"]
