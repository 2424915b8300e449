"""gpt-oss (openai/gpt-oss-20b, openai/gpt-oss-120b), the ``gpt_oss`` model type."""

from raymoe.models.common.family import ModelFamily
from raymoe.models.gpt_oss.config import GPT_OSS_DEFAULTS, parse_gpt_oss_config
from raymoe.models.gpt_oss.model import GptOssForCausalLM

FAMILY = ModelFamily("gpt_oss", GPT_OSS_DEFAULTS, GptOssForCausalLM, parse=parse_gpt_oss_config)

__all__ = ["FAMILY", "GPT_OSS_DEFAULTS", "GptOssForCausalLM"]
