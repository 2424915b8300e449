"""GLM-4.5 / GLM-4.6 (zai-org/GLM-4.5, GLM-4.5-Air), the ``glm4_moe`` model type."""

from raymoe.models.common.family import ModelFamily
from raymoe.models.glm4_moe.config import GLM4_MOE_DEFAULTS, parse_glm4_moe_config
from raymoe.models.glm4_moe.model import Glm4MoeForCausalLM

FAMILY = ModelFamily("glm4_moe", GLM4_MOE_DEFAULTS, Glm4MoeForCausalLM, parse=parse_glm4_moe_config)

__all__ = ["FAMILY", "GLM4_MOE_DEFAULTS", "Glm4MoeForCausalLM"]
